# What the scripts of tests/build share. Each sources it from the tree's
# root after `set -eu`; $name is the script's, as its FAIL lines say it.
name=$(basename "$0" .sh)

# Make $t, a directory of this run's own (NAME in its name), removed however
# the script ends: an interrupt or a TERM ends it as the shell's status says.
scratch() { # $1: NAME
  t=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-$1.XXXXXX")
  trap 'rm -rf "$t"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

# A build tree of this run's own in $o (a scratch directory) for make with
# $jobs jobs, none of the caller's make flags or HIP choice reaching it.
fresh_build() { # $1: NAME
  unset MAKEFLAGS MFLAGS MAKELEVEL HIP
  scratch "$1"
  o=$t
  jobs=$(nproc 2>/dev/null || echo 2)
}

# Say what failed and go on: the script ends with `[ "$status" -eq 0 ] ||
# exit 1`. A script that stops at its first failure defines its own fail.
status=0
fail() { echo "FAIL: $name: $*"; status=1; }
