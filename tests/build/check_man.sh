#!/bin/sh
# The man pages keep in step with the programs and the header: every option
# and command that `gpumemd --help` and `gpumemctl --help` of an already
# built tree ($GPUMEM_O, the Makefile's O) print is documented in man/, every
# GPUMEM_EXPORT function of include/gpumem.h in libgpumem.3.scd (and no
# function that is not there). Where scdoc is, each page must render, and
# where groff is, without warnings; without scdoc the sources are still
# checked and rendering is skipped, saying so.
set -eu
cd "$(dirname "$0")/../.."
. tests/build/lib.sh
o=${GPUMEM_O:-build}
scratch man

# The long options a program's --help names, one a line.
options() { # $1: help text file
  grep -o -- '--[a-z][a-z-]*' "$1" | sort -u
}

# Each option must appear as a bold term (*--name*) in the page.
check_options() { # $1: program, $2: page source
  "$o/bin/$1" --help > "$t/$1.help" 2>&1 || fail "$1 --help failed: $(cat "$t/$1.help")"
  for opt in $(options "$t/$1.help"); do
    grep -qF -- "*$opt*" "$2" || fail "$2 does not document $1 $opt"
  done
}

check_options gpumemd man/gpumemd.8.scd
check_options gpumemctl man/gpumemctl.1.scd

# gpumemctl's commands (the first word of each line under "commands:") each
# have an entry of their own: a line that starts with *command*.
cmds=$(sed -n '/^commands:/,/^options:/s/^  \([a-z][a-z-]*\) .*/\1/p' "$t/gpumemctl.help")
[ -n "$cmds" ] || fail "no commands found in gpumemctl --help"
for cmd in $cmds; do
  grep -q "^\*$cmd\*" man/gpumemctl.1.scd || fail "man/gpumemctl.1.scd has no entry for command $cmd"
done

# Every exported function has a prototype entry (name*( in the source), and
# every entry names an exported function.
sed -n 's/^GPUMEM_EXPORT [^(]*[ *]\(gpumem_[a-z0-9_]*\)(.*/\1/p' include/gpumem.h |
  sort -u > "$t/exported"
[ -s "$t/exported" ] || fail "no GPUMEM_EXPORT functions found in include/gpumem.h"
grep -o 'gpumem_[a-z0-9_]*\*(' man/libgpumem.3.scd | sed 's/\*($//' | sort -u > "$t/documented"
for fn in $(comm -23 "$t/exported" "$t/documented"); do
  fail "man/libgpumem.3.scd does not document $fn"
done
for fn in $(comm -13 "$t/exported" "$t/documented"); do
  fail "man/libgpumem.3.scd documents $fn, which include/gpumem.h does not export"
done

# Rendering.
if ! command -v scdoc >/dev/null 2>&1; then
  echo "check_man: scdoc not installed: sources checked, rendering skipped"
else
  for src in man/*.scd; do
    page=$t/$(basename "$src" .scd)
    scdoc < "$src" > "$page" 2> "$t/scdoc.log" || fail "scdoc $src: $(cat "$t/scdoc.log")"
    if command -v groff >/dev/null 2>&1; then
      LC_ALL=C.UTF-8 groff -man -Tutf8 -ww -z "$page" > "$t/groff.log" 2>&1 || true
      [ ! -s "$t/groff.log" ] || fail "groff warns about $src: $(cat "$t/groff.log")"
    fi
  done
  if [ "$status" -ne 0 ]; then
    :
  elif command -v groff >/dev/null 2>&1; then
    echo "check_man: rendered with scdoc and groff, no warnings"
  else
    echo "check_man: rendered with scdoc; groff not installed: warnings not checked"
  fi
fi
[ "$status" -eq 0 ] || exit 1
echo "check_man: $(wc -l < "$t/exported") functions, gpumemd's and gpumemctl's options and commands documented"
