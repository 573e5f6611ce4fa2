#!/bin/sh
# Run each Check suite; every test forks and has a timeout. Fails if any does.
set -u
. "$(dirname "$0")/others.sh"
others_setup
# A signal ends the run (the EXIT trap cleans up); it does not go on.
trap others_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
status=0
times=""
for t in "$@"; do
  name=$(basename "$t")
  start=$(date +%s)
  if ! "$t"; then
    echo "FAIL: $name"
    status=1
  fi
  times="$times $name $(($(date +%s) - start))s"
done
echo "seconds per suite:$times"
[ $status -eq 0 ] && echo "all suites passed"
exit $status
