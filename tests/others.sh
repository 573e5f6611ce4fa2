# Sourced by tests/run.sh and tests/build/check_top.sh: tests that run the
# build's programs as user nobody need them where nobody can reach them. A
# clone under a private directory (root's /root is 0700) is not, so there
# others_setup copies the programs and libraries into a temporary
# directory that nobody can read and exports it as GPUMEM_OTHERS_BUILD
# (tests/harness.c); others_cleanup removes it. Where nobody can run them
# from neither place, the tests that need it skip, saying why.
#   GPUMEM_BUILD: the build directory (absolute)
OTHERS_DIR=""
others_setup() {
  [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null 2>&1 || return 0
  nobody="setpriv --reuid=65534 --regid=65534 --clear-groups"
  $nobody test -x "$GPUMEM_BUILD/bin/gpumemctl" -a -r "$GPUMEM_BUILD/lib/libgpumem.so.1" \
    2>/dev/null && return 0
  OTHERS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-others.XXXXXX")
  cp -a "$GPUMEM_BUILD/bin" "$GPUMEM_BUILD/lib" "$OTHERS_DIR/"
  chmod -R a+rX "$OTHERS_DIR"
  if $nobody "$OTHERS_DIR/bin/gpumemctl" --version >/dev/null 2>&1; then
    export GPUMEM_OTHERS_BUILD="$OTHERS_DIR"
    echo "tests: nobody cannot reach $GPUMEM_BUILD: the programs tests run as nobody are copied to $OTHERS_DIR"
  else
    others_cleanup
    echo "tests: nobody can run the build's programs neither from $GPUMEM_BUILD nor from ${TMPDIR:-/tmp}: the tests that need it skip"
  fi
}
others_cleanup() {
  [ -z "$OTHERS_DIR" ] || rm -rf "$OTHERS_DIR"
  OTHERS_DIR=""
}
