#!/bin/sh
# The packaging keeps in step with the code, in an already built tree
# ($GPUMEM_O, the Makefile's O); needs no dpkg-dev and no lintian, only nm
# or readelf (binutils, which the compiler brings).
#
# Symbols: the functions libgpumem.so exports, those include/gpumem.h
# declares (GPUMEM_EXPORT) and those debian/libgpumem1.symbols lists are
# one set, each symbol missing on a side named. (A symbol the library
# exports and the symbols file lacks is what lintian's
# symbols-file-contains-current-version-with-debian-revision reports at
# make deb.) The symbols file's soname is the library's, and each symbol's
# version is an upstream version no later than this one.
#
# Version: include/gpumem.h's GPUMEM_VERSION_MAJOR.MINOR.PATCH is the
# project's one version. What cannot be derived from it must equal it: the
# top entry of debian/changelog (its upstream part), python/pyproject.toml's
# version; and what is derived is checked too: the built gpumem.pc,
# gpumemd --version and gpumemctl --version (its own and libgpumem's).
set -eu
cd "$(dirname "$0")/../.."
. tests/build/lib.sh
o=${GPUMEM_O:-build}
scratch package

lib=$o/lib/libgpumem.so
symfile=debian/libgpumem1.symbols
[ -f "$lib" ] || { echo "FAIL: check_package: no $lib (build first: make O=$o)"; exit 1; }

# --- symbols ---------------------------------------------------------------

# The dynamic symbols the library defines, less the few a linker may add.
if command -v nm >/dev/null 2>&1; then
  nm -D --defined-only "$lib" | awk 'NF >= 3 { print $3 }' > "$t/dyn"
elif command -v readelf >/dev/null 2>&1; then
  readelf -W --dyn-syms "$lib" |
    awk '$1 ~ /^[0-9]+:$/ && $7 != "UND" && $5 != "LOCAL" && $8 != "" { print $8 }' > "$t/dyn"
else
  echo "FAIL: check_package: neither nm nor readelf (binutils) is installed"; exit 1
fi
sed 's/@.*//' "$t/dyn" | grep -v -x -e _init -e _fini -e _edata -e _end -e __bss_start |
  sort -u > "$t/exported"
[ -s "$t/exported" ] || fail "nm finds no symbol that $lib exports"

# The functions the header declares (as check_man.sh reads them).
sed -n 's/^GPUMEM_EXPORT [^(]*[ *]\(gpumem_[a-z0-9_]*\)(.*/\1/p' include/gpumem.h |
  sort -u > "$t/declared"
[ -s "$t/declared" ] || fail "no GPUMEM_EXPORT functions found in include/gpumem.h"

# The symbols file: "soname package #MINVER#", "* field: value" lines, then
# " [(tags)]name@version minver".
sed -n 's/^ \(([^)]*)\)\{0,1\}\([^@ ]*\)@\([^ ]*\) \([^ ]*\).*/\2 \3 \4/p' "$symfile" > "$t/listed.full"
cut -d' ' -f1 "$t/listed.full" | sort -u > "$t/listed"
[ -s "$t/listed" ] || fail "no symbols found in $symfile"

# Fail for each symbol of the sorted list $1 that the list $2 lacks, saying
# $3 with the symbol for each %s.
lacks() {
  for s in $(comm -23 "$1" "$2"); do fail "$(printf '%s\n' "$3" | sed "s/%s/$s/g")"; done
}
lacks "$t/exported" "$t/listed" \
  "$lib exports %s, which $symfile does not list (add ' %s@Base <upstream version that added it>')"
lacks "$t/listed" "$t/exported" "$symfile lists %s, which $lib does not export"
lacks "$t/exported" "$t/declared" "$lib exports %s, which include/gpumem.h does not declare GPUMEM_EXPORT"
lacks "$t/declared" "$t/exported" "include/gpumem.h declares %s, which $lib does not export"

# Each symbol's version: @Base, an upstream version (no Debian revision,
# which lintian refuses), no later than the header's.
vnum() { # a.b.c -> a*10000 + b*100 + c (as GPUMEM_VERSION)
  echo "$1" | awk -F. '{ printf "%d\n", $1 * 10000 + $2 * 100 + $3 }'
}

# --- version ---------------------------------------------------------------

macro() { sed -n "s/^#define GPUMEM_VERSION_$1 \\([0-9][0-9]*\\)\$/\\1/p" include/gpumem.h; }
major=$(macro MAJOR) minor=$(macro MINOR) patch=$(macro PATCH)
if [ -z "$major" ] || [ -z "$minor" ] || [ -z "$patch" ]; then
  echo "FAIL: check_package: no GPUMEM_VERSION_MAJOR, MINOR and PATCH in include/gpumem.h"; exit 1
fi
version=$major.$minor.$patch
vcur=$(vnum "$version")

while read -r name ver minver; do
  [ "$ver" = Base ] || fail "$symfile: $name@$ver: the version node must be Base"
  case $minver in
    *-*) fail "$symfile: $name: $minver carries a Debian revision (give the upstream version)" ;;
    [0-9]*.[0-9]*.[0-9]*)
      [ "$(vnum "$minver")" -le "$vcur" ] ||
        fail "$symfile: $name: $minver is later than this version, $version" ;;
    *) fail "$symfile: $name: '$minver' is not an upstream version (major.minor.patch)" ;;
  esac
done < "$t/listed.full"

# The soname in the symbols file and the package it names (libgpumem<major>).
read -r sym_soname sym_package _ < "$symfile" || true
if command -v readelf >/dev/null 2>&1; then
  soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]$/\1/p')
  [ "${sym_soname:-}" = "$soname" ] ||
    fail "$symfile is for ${sym_soname:-?}; $lib's soname is ${soname:-none}"
fi
[ "${sym_package:-}" = "libgpumem$major" ] ||
  fail "$symfile names package ${sym_package:-?}; the library of major $major is libgpumem$major"

# same WHAT FOUND: FOUND must be the header's version.
same() {
  if [ -z "$2" ]; then fail "$1: no version found (expected $version)"
  elif [ "$2" != "$version" ]; then fail "$1 says $2; include/gpumem.h says $version"
  fi
}

# debian/changelog's top entry: "gpumemd ([epoch:]upstream-revision) ...".
deb=$(sed -n '1s/^[^ ]* (\([^)]*\)).*/\1/p' debian/changelog)
up=${deb#*:}
up=${up%-*}
same "debian/changelog ($deb)" "$up"

# python/pyproject.toml: version in [project].
py=$(awk '/^\[/ { p = ($0 == "[project]") } p && /^version *=/ {
  sub(/^version *= *"/, ""); sub(/".*/, ""); print; exit }' python/pyproject.toml)
same "python/pyproject.toml" "$py"
same "python/gpumem/__init__.py" "$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' python/gpumem/__init__.py)"

if [ -f "$o/lib/gpumem.pc" ]; then
  same "$o/lib/gpumem.pc" "$(sed -n 's/^Version: *//p' "$o/lib/gpumem.pc")"
else
  fail "no $o/lib/gpumem.pc"
fi

# gpumemd --version: "gpumemd 1.4.0 (protocol 1.4)" first.
if "$o/bin/gpumemd" --version > "$t/gpumemd.out" 2>&1; then
  same "gpumemd --version" "$(sed -n '1s/^gpumemd \([^ ]*\).*/\1/p' "$t/gpumemd.out")"
else
  fail "$o/bin/gpumemd --version failed: $(cat "$t/gpumemd.out")"
fi

# gpumemctl --version: its own and the library's, then the daemon's (a
# socket where none listens: no daemon is asked).
if "$o/bin/gpumemctl" --socket "$t/none.sock" --version > "$t/ctl.out" 2>&1; then
  same "gpumemctl --version" "$(sed -n 's/^gpumemctl \([^ ]*\)$/\1/p' "$t/ctl.out")"
  same "gpumemctl --version's libgpumem" "$(sed -n 's/^libgpumem \([^ ]*\)$/\1/p' "$t/ctl.out")"
else
  fail "$o/bin/gpumemctl --version failed: $(cat "$t/ctl.out")"
fi

[ "$status" -eq 0 ] || exit 1
echo "check_package: $(wc -l < "$t/exported") symbols exported, declared and in $symfile;" \
  "version $version in the header, debian/changelog ($deb), pyproject.toml, gpumem.pc," \
  "gpumemd and gpumemctl"
