#!/bin/sh
# The layering of the sources holds (tools/layers.py, from the objects'
# own symbol tables): no two files of one folder call each other, directly
# or around a loop, and no file calls a layer above its own. And the check
# itself fails where it should: on objects made here with a back-call in
# daemon/ and a call from common/ up to daemon/.
#   GPUMEM_O  the build to check (default build)
set -eu
cd "$(dirname "$0")/../.."
o=${GPUMEM_O:-build}
t=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-layers.XXXXXX")
trap 'rm -rf "$t"' EXIT
fail() { printf 'FAIL: check_layers: %s\n' "$*"; exit 1; }

python3 tools/layers.py "$o" >"$t/tree.out" 2>&1 || fail "$(cat "$t/tree.out")"

# A made-up tree: daemon/a.c and daemon/b.c call each other, common/c.c
# calls daemon/a.c.
mkdir -p "$t/src/daemon" "$t/src/common" "$t/obj/daemon" "$t/obj/common"
printf 'int b(void);\nint a(void) { return b(); }\n' >"$t/src/daemon/a.c"
printf 'int a(void);\nint b(void) { return 1; }\nint b2(void) { return a(); }\n' >"$t/src/daemon/b.c"
printf 'int a(void);\nint c(void) { return a(); }\n' >"$t/src/common/c.c"
for f in daemon/a daemon/b common/c; do
  ${CC:-cc} -c -o "$t/obj/$f.o" "$t/src/$f.c"
done
if python3 tools/layers.py "$t" "$t/src" >"$t/bad.out" 2>&1; then
  fail "a tree with a cycle and a call upwards passed: $(cat "$t/bad.out")"
fi
grep -q '^cycle in daemon/: daemon/a.c <-> daemon/b.c$' "$t/bad.out" ||
  fail "the cycle in daemon/ not said: $(cat "$t/bad.out")"
grep -q '^layer: common/c.c (common) calls daemon/a.c (daemon): a$' "$t/bad.out" ||
  fail "the call upwards not said: $(cat "$t/bad.out")"
# Without the back-call, the same tree passes; and an object whose source
# is gone does not count.
rm "$t/src/daemon/b.c" "$t/src/common/c.c"
python3 tools/layers.py "$t" "$t/src" >"$t/good.out" 2>&1 ||
  fail "a tree without the back-call failed: $(cat "$t/good.out")"
echo "check_layers: $(tail -1 "$t/tree.out" | sed 's/^layers: //'); a made-up back-call and call upwards are caught"
