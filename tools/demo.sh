#!/bin/sh
# make demo: gpumemd on the host backend with two real workers, and one
# pause and resume of their tags, with the kernel's own memory figures.
set -eu
build=${1:-build}
bin=$build/bin
dir=$(mktemp -d /tmp/gpumemd-demo.XXXXXX)
sock=$dir/gpumemd.sock
. "$(dirname "$0")/children.sh"
cleanup() {
  children_signal TERM ${w1:-} ${w2:-} ${d:-}
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

shmem() { awk '/^Shmem:/ { printf "%.0f MiB", $2 / 1024 }' /proc/meminfo; }
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

echo "gpumemd demo: daemon on the host backend, workers in their own processes"
# GPUMEM_DEMO_DAEMON_FLAGS: more flags for the daemon (the README's test of
# this demo gives a sanitizer build's slow workers a longer --ack-timeout).
# shellcheck disable=SC2086
"$bin/gpumemd" --socket "$sock" --backend host --host-devices 2 --host-device-size 2G \
  ${GPUMEM_DEMO_DAEMON_FLAGS:-} 2>"$dir/daemon.log" &
d=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
echo "Shmem before workers: $(shmem)"

"$bin/gpumem-worker" --socket "$sock" --name vllm-rank0 --tag kv_cache --size 256M --count 2 >"$dir/w1.log" 2>&1 &
w1=$!
"$bin/gpumem-worker" --socket "$sock" --name vllm-rank0-weights --tag weights --size 128M --backup --device 1 >"$dir/w2.log" 2>&1 &
w2=$!
for _ in $(seq 200); do
  grep -q ready "$dir/w1.log" 2>/dev/null && grep -q ready "$dir/w2.log" 2>/dev/null && break
  sleep 0.05
done
echo "Shmem with workers:   $(shmem)"

step gpumemctl status
"$bin/gpumemctl" --socket "$sock" status
step gpumemctl pause kv_cache weights
"$bin/gpumemctl" --socket "$sock" pause kv_cache weights
echo "Shmem while paused:   $(shmem)"
step gpumemctl status
"$bin/gpumemctl" --socket "$sock" status
step gpumemctl resume kv_cache weights
"$bin/gpumemctl" --socket "$sock" resume kv_cache weights
sleep 0.2
echo "Shmem after resume:   $(shmem)"
step gpumemctl list
"$bin/gpumemctl" --socket "$sock" list

kill "$w1" "$w2"
s1=0; s2=0
wait "$w1" || s1=$?
wait "$w2" || s2=$?
w1=; w2=
printf '\n\033[1mworker kv_cache said:\033[0m\n'; cat "$dir/w1.log"
printf '\n\033[1mworker weights said:\033[0m\n'; cat "$dir/w2.log"
kill "$d"; wait "$d" || true; d=
printf '\n\033[1mdaemon log:\033[0m\n'; cat "$dir/daemon.log"
if [ "$s1" -eq 0 ] && [ "$s2" -eq 0 ]; then
  echo; echo "demo passed: memory released on pause, taken again and verified on resume"
else
  echo; echo "demo FAILED: worker exit status $s1, $s2"; exit 1
fi
