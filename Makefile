# gpumemd: `make` builds into build/, `make check` runs every test (also
# under ASan+UBSan), `make demo` shows a pause and resume with real workers.

# Where `make install` puts things (GNU names; DESTDIR for staging).
# Debian multiarch: make install PREFIX=/usr LIBDIR=/usr/lib/x86_64-linux-gnu
PREFIX ?= /usr/local
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
SBINDIR ?= $(PREFIX)/sbin
LIBDIR ?= $(PREFIX)/lib
LIBEXECDIR ?= $(PREFIX)/libexec
INCLUDEDIR ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
# systemd's units and sysusers.d (Debian 12's debhelper wants the units in
# /lib/systemd/system: debian/rules says so), and the man pages.
SYSTEMDUNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
MANDIR ?= $(PREFIX)/share/man
LDCONFIG ?= ldconfig
O ?= build
SAN ?= 0

CC ?= cc
# xxHash (XXH3) checks backups and names the host backend's devices.
PKGS := libuv libprotobuf-c libxxhash
# sd_notify and socket activation come from libsystemd where its headers
# are (make deps installs them); a node without them (a GPU node with no
# package registry) builds a daemon that refuses NOTIFY_SOCKET and
# LISTEN_FDS with a clear error instead.
SYSTEMD ?= $(shell pkg-config --exists libsystemd 2>/dev/null && echo 1 || echo 0)
ifeq ($(SYSTEMD),1)
PKGS += libsystemd
CFLAGS_HAVE := -DHAVE_SYSTEMD
endif
# Disk backups queue their I/O through io_uring where liburing's headers
# are (make deps installs them); without, they use pread and pwrite.
LIBURING ?= $(shell pkg-config --exists liburing 2>/dev/null && echo 1 || echo 0)
ifeq ($(LIBURING),1)
PKGS += liburing
CFLAGS_HAVE += -DHAVE_LIBURING
endif
WERROR ?= -Werror
WARN := -Wall -Wextra $(WERROR) -Wshadow -Wformat=2 -Wmissing-prototypes \
        -Wstrict-prototypes -Wpointer-arith -Wno-unused-parameter
# CPPFLAGS, CFLAGS and LDFLAGS from the environment or the command line
# (Debian's hardening flags) are kept and added to; packagers who want no
# -Werror pass WERROR=.
CFLAGS ?= -O2 -g
# The values given, before this Makefile adds to them: the environment of
# a make run from a recipe gets these (it would get the added-to values).
ENV_CFLAGS := $(CFLAGS)
ENV_LDFLAGS := $(LDFLAGS)
SUBMAKE_ENV = CFLAGS=$(call sq,$(ENV_CFLAGS)) LDFLAGS=$(call sq,$(ENV_LDFLAGS))
override CFLAGS += $(CPPFLAGS) -std=c11 -D_GNU_SOURCE $(WARN) -fPIC -fvisibility=hidden -I. -I$(O)/gen -Iinclude $(CFLAGS_HAVE)
ifeq ($(SAN),1)
override CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
override LDFLAGS += -fsanitize=address,undefined
endif
ifeq ($(SAN),thread)
override CFLAGS += -fsanitize=thread -fno-omit-frame-pointer
override LDFLAGS += -fsanitize=thread
endif
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS = $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_LIBS = $(shell pkg-config --libs check 2>/dev/null)

# Vendor backends: built where their headers are, unless asked
# (make HIP=0 CUDA=1). Their runtimes are loaded with dlopen, so no binary
# needs them.
CUDA_HOME ?= /usr/local/cuda
ROCM_PATH ?= /opt/rocm
HIP_INCLUDE := $(patsubst %/hip/hip_runtime_api.h,%,$(firstword $(wildcard \
  $(ROCM_PATH)/include/hip/hip_runtime_api.h /usr/include/hip/hip_runtime_api.h)))
CUDA ?= $(if $(wildcard $(CUDA_HOME)/include/cuda.h),1,0)
HIP ?= $(if $(HIP_INCLUDE),1,0)
# The GPU layer (gpu/) in three parts: below, what both halves use (the
# error words, and per vendor the runtime loaded with dlopen and the VMM
# state over it); the daemon's half (GPUDEV: chunks, exports, backups,
# device figures, contexts); the client's half (GPUVA: address ranges,
# imports, mappings). gpumemd links the daemon's half, libgpumem.so the
# client's: each program what it calls.
GPU_SRC := gpu/error.c
GPUDEV_SRC := gpu/gpudev.c gpu/host_dev.c gpu/host_freeze.c gpu/host_live.c gpu/host_proc.c \
  gpu/populate.c
GPUVA_SRC := gpu/gpuva.c gpu/host_va.c
GPU_VMM_SRC := gpu/vmm.c
GPUDEV_VMM_SRC := gpu/vmm_dev.c gpu/vmm_backup.c gpu/vmm_ckpt.c gpu/vmm_gate.c
GPUVA_VMM_SRC := gpu/vmm_va.c
# Each GPU backend built (CUDA=1: cuda, HIP=1: hip) adds the VMM layer and
# its own three files.
GPU_BACKENDS := $(if $(filter 1,$(CUDA)),cuda) $(if $(filter 1,$(HIP)),hip)
ifneq ($(strip $(GPU_BACKENDS)),)
GPU_SRC += $(GPU_VMM_SRC) $(GPU_BACKENDS:%=gpu/%_lib.c)
GPUDEV_SRC += $(GPUDEV_VMM_SRC) $(GPU_BACKENDS:%=gpu/%_dev.c)
GPUVA_SRC += $(GPUVA_VMM_SRC) $(GPU_BACKENDS:%=gpu/%_va.c)
endif
ifeq ($(CUDA),1)
override CFLAGS += -DHAVE_CUDA
$(O)/obj/gpu/cuda_lib.o $(O)/obj/gpu/cuda_dev.o $(O)/obj/gpu/cuda_va.o: \
  override CFLAGS += -isystem $(CUDA_HOME)/include
endif
ifeq ($(HIP),1)
override CFLAGS += -DHAVE_HIP
$(O)/obj/gpu/hip_lib.o $(O)/obj/gpu/hip_dev.o $(O)/obj/gpu/hip_va.o: \
  override CFLAGS += -isystem $(HIP_INCLUDE) -Wno-strict-prototypes
endif
GPU_SRC := $(sort $(GPU_SRC))
GPUDEV_SRC := $(sort $(GPUDEV_SRC))
GPUVA_SRC := $(sort $(GPUVA_SRC))

GEN := $(O)/gen/proto/gpumemd.pb-c.c
COMMON_SRC := common/frame.c common/idmap.c common/log.c common/procstat.c common/size.c \
  common/wire.c
DAEMON_SRC := $(wildcard daemon/*.c)
CLIENT_SRC := $(wildcard client/*.c)
CTL_SRC := $(wildcard ctl/*.c)

obj = $(patsubst %.c,$(O)/obj/%.o,$(1))
COMMON_OBJ := $(call obj,$(COMMON_SRC)) $(O)/obj/gen/gpumemd.pb-c.o
GPU_OBJ := $(call obj,$(GPU_SRC))
GPUDEV_OBJ := $(call obj,$(GPUDEV_SRC))
GPUVA_OBJ := $(call obj,$(GPUVA_SRC))
# What a program that calls the GPU layer links, above its own objects:
# the daemon's half, the client's, or both (tests and benchmarks), then
# what is below them.
GPUDEV_LIBS := $(O)/lib/libgpudev.a $(O)/lib/libgpu.a
GPUVA_LIBS := $(O)/lib/libgpuva.a $(O)/lib/libgpu.a
GPU_BOTH_LIBS := $(O)/lib/libgpudev.a $(O)/lib/libgpuva.a $(O)/lib/libgpu.a
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
CLIENT_OBJ := $(call obj,$(CLIENT_SRC))
CTL_OBJ := $(call obj,$(CTL_SRC))
# gpumemctl top draws with curses: ncursesw where its headers are (make
# deps installs them); without, top says gpumemctl was built without it.
NCURSES ?= $(shell pkg-config --exists ncursesw 2>/dev/null && echo 1 || echo 0)
ifeq ($(NCURSES),1)
$(CTL_OBJ): override CFLAGS += -DHAVE_NCURSES $(shell pkg-config --cflags ncursesw)
CTL_LIBS := $(shell pkg-config --libs ncursesw)
endif
CTL_LIBS += -lpthread

BINS := $(O)/bin/gpumemd $(O)/bin/gpumemctl $(O)/bin/gpumem-worker
EXAMPLES := $(O)/examples/worker
LIBS := $(O)/lib/libgpumem.so $(O)/lib/gpumem.pc $(O)/lib/libgpumem_preload.so
# Suites: tests/in_process/ run the code in the test's own process;
# tests/with_daemon/ spawn gpumemd and real workers. Each builds to
# $(O)/tests/<name>.
SUITE_SRC := $(wildcard tests/in_process/check_*.c tests/with_daemon/check_*.c)
TESTS := $(patsubst %.c,$(O)/tests/%,$(notdir $(SUITE_SRC)))
BENCHES := $(patsubst bench/%.c,$(O)/bench/%,$(wildcard bench/*.c))

.PHONY: all deps check test test-asan test-tsan fuzz demo bench install uninstall clean FORCE
# The programs make install installs, linked without RUNPATH (below).
INST_BINS := $(O)/inst/bin/gpumemctl $(O)/inst/bin/gpumem-worker
all: $(BINS) $(LIBS) $(EXAMPLES) $(INST_BINS)

# Install missing packages: only demo and check do it, never plain make.
# Run with sh: on a clone where nothing may be executed, preflight says so.
deps:
	@sh tools/preflight.sh $(O)
	@sh tools/install-deps.sh

# The backends and flags every object was built with: rewritten only when
# they change, so that a change rebuilds everything. HIP=1 without the
# headers stops here.
BUILD_CONFIG := $(O)/build-config
sq = '$(subst ','\'',$(1))'
# What a build cannot start without (make deps installs it).
MISSING = $(if $(shell command -v pkg-config 2>/dev/null),,pkg-config) \
  $(if $(shell command -v protoc-c 2>/dev/null),,protoc-c) \
  $(foreach p,$(PKGS),$(if $(shell pkg-config --exists $(p) 2>/dev/null && echo y),,$(p)))
$(BUILD_CONFIG): FORCE
	$(if $(filter 1,$(HIP)),$(if $(HIP_INCLUDE),,$(error HIP=1 but no hip/hip_runtime_api.h in $(ROCM_PATH)/include or /usr/include)))
	$(if $(strip $(MISSING)),$(error missing $(strip $(MISSING)): run make deps first (it installs them with apt-get), or make demo or make check, which do))
	@mkdir -p $(@D)
	@printf '%s\n' $(call sq,CC=$(CC)) $(call sq,CUDA=$(CUDA) $(CUDA_HOME)) \
	  $(call sq,HIP=$(HIP) $(HIP_INCLUDE)) $(call sq,NCURSES=$(NCURSES)) $(call sq,CFLAGS=$(CFLAGS) $(PKG_CFLAGS)) \
	  $(call sq,LDFLAGS=$(LDFLAGS)) > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

$(GEN): proto/gpumemd.proto | $(BUILD_CONFIG)
	@mkdir -p $(O)/gen
	@echo "  PROTOC  $<"
	@# protoc-c of Debian 13 says it is deprecated in favour of protoc, which
	@# need not be installed: that one line is left out, the rest is shown.
	@protoc-c --c_out=$(O)/gen $< 2>$(O)/gen/protoc.err; rc=$$?; \
	  grep -v '`protoc-c` is deprecated' $(O)/gen/protoc.err >&2; rm -f $(O)/gen/protoc.err; exit $$rc

$(O)/obj/gen/gpumemd.pb-c.o: $(GEN) $(BUILD_CONFIG)
	@mkdir -p $(@D)
	@echo "  CC      $<"
	@$(CC) $(CFLAGS) $(PKG_CFLAGS) -Wno-missing-prototypes -c $< -o $@

$(O)/obj/%.o: %.c $(GEN) $(BUILD_CONFIG)
	@mkdir -p $(@D)
	@echo "  CC      $<"
	@$(CC) $(CFLAGS) $(PKG_CFLAGS) -MMD -MP -c $< -o $@

# The static libraries, each of its objects.
$(O)/lib/libcommon.a: $(COMMON_OBJ)
$(O)/lib/libgpu.a: $(GPU_OBJ)
$(O)/lib/libgpudev.a: $(GPUDEV_OBJ)
$(O)/lib/libgpuva.a: $(GPUVA_OBJ)
$(addprefix $(O)/lib/,libcommon.a libgpu.a libgpudev.a libgpuva.a):
	@mkdir -p $(@D)
	@rm -f $@
	@$(AR) rcs $@ $^

$(O)/bin/gpumemd: $(DAEMON_OBJ) $(GPUDEV_LIBS) $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(LDFLAGS) -o $@ $^ $(PKG_LIBS) -ldl -lm

# The client library exports only what include/gpumem.h declares.
$(O)/lib/libgpumem.so: $(CLIENT_OBJ) $(GPUVA_LIBS) $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(LDFLAGS) -shared -Wl,-soname,libgpumem.so.1 -Wl,--exclude-libs,ALL \
	  -o $@ $^ $(shell pkg-config --libs libprotobuf-c) -lpthread -ldl -lm
	@ln -sf libgpumem.so $(O)/lib/libgpumem.so.1

# The LD_PRELOAD library (preload/): a program's cudaMalloc and hipMalloc
# served by gpumemd; it finds libgpumem next to itself.
$(O)/lib/libgpumem_preload.so: $(O)/obj/preload/preload.o $(O)/obj/common/idmap.o $(O)/lib/libgpumem.so
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(LDFLAGS) -shared -o $@ $(filter %.o,$^) -L$(O)/lib -lgpumem \
	  -Wl,-rpath,'$$ORIGIN' -ldl -lpthread

# gpumem.pc for PREFIX, LIBDIR and INCLUDEDIR (under ${prefix} where they
# are below it); make install writes its own for the place it installs to.
pc_dir = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))
# The version is the header's (GPUMEM_VERSION_MAJOR.MINOR.PATCH).
VERSION := $(shell sed -n 's/^\#define GPUMEM_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$$/\2/p' \
  include/gpumem.h | paste -sd.)
make_pc = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(call pc_dir,$(LIBDIR))|g' \
  -e 's|@INCLUDEDIR@|$(call pc_dir,$(INCLUDEDIR))|g' -e 's|@VERSION@|$(VERSION)|g' \
  client/gpumem.pc.in
$(O)/lib/gpumem.pc: client/gpumem.pc.in include/gpumem.h
	@mkdir -p $(@D)
	@$(call make_pc) > $@

RPATH := -Wl,-rpath,'$$ORIGIN/../lib'
# gpumemctl is ctl/: one module per view (status, metrics, top).
CTL_LINK = $(CC) $(LDFLAGS) -o $@ $(CTL_OBJ) -L$(O)/lib -lgpumem $(O)/lib/libcommon.a \
  $(shell pkg-config --libs libprotobuf-c) $(CTL_LIBS) -ldl -lm
$(O)/bin/gpumemctl: $(CTL_OBJ) $(O)/lib/libgpumem.so $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CTL_LINK) $(RPATH)
$(O)/inst/bin/gpumemctl: $(CTL_OBJ) $(O)/lib/libgpumem.so $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CTL_LINK)
$(O)/bin/%: tools/%.c $(O)/lib/libgpumem.so $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< -L$(O)/lib -lgpumem $(O)/lib/libcommon.a \
	  $(shell pkg-config --libs libprotobuf-c) $(RPATH) -ldl -lm

SUITE_DEPS := tests/harness.c tests/harness.h tests/scenario.c tests/scenario.h tests/procfd.c \
  $(O)/lib/libgpumem.so $(GPU_BOTH_LIBS) $(O)/lib/libcommon.a $(DAEMON_OBJ)
SUITE_LINK = @mkdir -p $(@D); echo "  LD      $@"; \
  $(CC) $(CFLAGS) $(PKG_CFLAGS) $(LDFLAGS) -Itests -o $@ $< tests/harness.c tests/scenario.c tests/procfd.c \
  $(filter-out $(O)/obj/daemon/main.o,$(DAEMON_OBJ)) \
  -L$(O)/lib -lgpumem $(GPU_BOTH_LIBS) $(O)/lib/libcommon.a $(PKG_LIBS) $(CHECK_LIBS) \
  -Wl,-rpath,'$(abspath $(O)/lib)' -lm
$(O)/tests/%: tests/in_process/%.c $(SUITE_DEPS)
	$(SUITE_LINK)
$(O)/tests/%: tests/with_daemon/%.c $(SUITE_DEPS)
	$(SUITE_LINK)

# The preload tests' stand-in vendor runtime, and a program linked to it
# as applications link libcudart.
$(O)/tests/libcudart_stub.so: tests/preload/fake_cudart.c $(BUILD_CONFIG)
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(LDFLAGS) -shared -o $@ $< -lpthread

# A test shim that shows a daemon a made-up /proc/meminfo and disk
# (check_backup_policy, check_backup_disk).
$(O)/tests/libfake_kernel.so: tests/preload/fake_kernel.c $(BUILD_CONFIG)
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(LDFLAGS) -shared -o $@ $< -ldl
$(O)/tests/check_backup_policy $(O)/tests/check_backup_disk: $(O)/tests/libfake_kernel.so

# The app gives TSan (a shared runtime, which finds it only exported:
# -rdynamic; its other functions are static) its suppressions: see
# __tsan_default_suppressions in preload_app.c.
$(O)/tests/preload_app: tests/preload/preload_app.c $(O)/tests/libcudart_stub.so
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< -L$(O)/tests -lcudart_stub -Wl,-rpath,'$$ORIGIN' -ldl -rdynamic

$(O)/tests/check_preload: $(O)/lib/libgpumem_preload.so $(O)/tests/preload_app

# The HIP suite's stand-in runtime (no AMD GPU here), under the name the
# HIP backend dlopens first; with HIP=0 check_hip only says it skipped.
ifeq ($(HIP),1)
$(O)/tests/hip/libamdhip64.so: tests/hip/fake_hip.c $(BUILD_CONFIG)
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) -isystem $(HIP_INCLUDE) -Wno-strict-prototypes $(LDFLAGS) -shared -o $@ $< \
	  -lpthread

$(O)/tests/check_hip: $(O)/tests/hip/libamdhip64.so
endif

# The README's example, built as a user would: public header and -lgpumem
# (with LDFLAGS: under SAN, the sanitizer runtime libgpumem then needs).
$(O)/examples/%: examples/%.c $(O)/lib/libgpumem.so
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) -std=c11 -Wall -Wextra -Werror -Iinclude $(LDFLAGS) -o $@ $< -L$(O)/lib -lgpumem $(RPATH)

$(O)/bench/%: bench/%.c $(O)/lib/libgpumem.so $(GPU_BOTH_LIBS) $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(PKG_CFLAGS) $(LDFLAGS) -o $@ $< -L$(O)/lib -lgpumem $(GPU_BOTH_LIBS) \
	  $(O)/lib/libcommon.a $(PKG_LIBS) -Wl,-rpath,'$(abspath $(O)/lib)' -ldl -lm

# Run the suites against binaries in $(O), then the Python package's tests
# (pytest, against a real daemon). Those run only without sanitizers
# (SAN=0): under ASan or TSan python would need the sanitizer runtime
# preloaded to load libgpumem. Python is python3, or Debian's
# /usr/bin/python3 (where python3-pytest installs) when python3 has no pytest;
# a node where nothing may be installed (GPUMEM_NO_APT) and that has no
# pytest skips them, saying so.
test: all $(TESTS)
	@GPUMEM_BUILD=$(abspath $(O)) ./tests/run.sh $(TESTS)
	@GPUMEM_BUILD=$(abspath $(O)) ./tests/build/check_top.sh
	@./systemd/verify.sh $(abspath $(O))
	@if [ "$(SAN)" != 0 ]; then echo "tests/python: skipped under SAN=$(SAN)"; \
	elif [ -n "$$GPUMEM_NO_APT" ] && ! python3 -c 'import pytest' 2>/dev/null && \
	     ! /usr/bin/python3 -c 'import pytest' 2>/dev/null; then \
	  echo "tests/python: skipped: no pytest here and GPUMEM_NO_APT set"; \
	else py=python3; python3 -c 'import pytest' 2>/dev/null || py=/usr/bin/python3; \
	  GPUMEM_BUILD=$(abspath $(O)) PYTHONPATH=python PYTHONDONTWRITEBYTECODE=1 \
	    $$py -m pytest -q -p no:cacheprovider tests/python; fi
	@if [ "$(SAN)" != 0 ]; then echo "tests/build/check_install.sh: skipped under SAN=$(SAN)"; \
	else $(SUBMAKE_ENV) GPUMEM_O=$(O) ./tests/build/check_install.sh; fi
	@GPUMEM_O=$(O) ./tests/build/check_man.sh
	@GPUMEM_O=$(O) ./tests/build/check_readme.sh
	@GPUMEM_O=$(O) ./tests/build/check_layers.sh
	@GPUMEM_O=$(O) ./tests/build/check_package.sh
	@if [ "$(SAN)" != 0 ]; then echo "tests/build/check_deps.sh: skipped under SAN=$(SAN)"; \
	else ./tests/build/check_deps.sh; fi
	@$(SUBMAKE_ENV) $(MAKE) --no-print-directory fuzz-replay

test-asan:
	@$(SUBMAKE_ENV) $(MAKE) --no-print-directory O=build/asan SAN=1 test

# Fuzzers (clang's libFuzzer, with ASan and UBSan): `make fuzz` runs each
# for FUZZ_SECONDS (default 60) from its seeds in tests/fuzz/corpus/<name>,
# keeps what it finds in build/fuzz/<name>.corpus and crashes in
# build/fuzz/<name>-crash-*, and prints executions, coverage and crashes.
# fuzz_daemon runs the daemon itself: every daemon object but main.o, on
# the host backend (no vendor backend: its sources are left out).
FUZZ_SECONDS ?= 60
FUZZ_NAMES := $(patsubst tests/fuzz/%.c,%,$(filter-out tests/fuzz/replay.c,$(wildcard tests/fuzz/*.c)))
FUZZERS := $(addprefix build/fuzz/,$(FUZZ_NAMES))
FUZZ_SRC := common/frame.c common/wire.c tests/procfd.c
FUZZ_CC = clang -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=address,undefined -I. -I$(O)/gen -Iinclude
build/fuzz/%: tests/fuzz/%.c $(FUZZ_SRC) $(GEN)
	@./tools/install-deps.sh fuzz
	@mkdir -p $(@D)
	@echo "  FUZZ    $@"
	@$(FUZZ_CC) -fsanitize=fuzzer -o $@ $< $(FUZZ_SRC) $(GEN) $(shell pkg-config --libs libprotobuf-c)
FUZZ_DAEMON_OBJ := $(patsubst %.c,build/fuzz/obj/%.o,$(COMMON_SRC) \
  $(filter-out gpu/cuda_% gpu/hip_% gpu/vmm%,$(GPU_SRC) $(GPUDEV_SRC)) \
  $(filter-out daemon/main.c,$(DAEMON_SRC))) build/fuzz/obj/gen/gpumemd.pb-c.o
build/fuzz/obj/gen/gpumemd.pb-c.o: $(GEN)
	@./tools/install-deps.sh fuzz
	@mkdir -p $(@D)
	@$(FUZZ_CC) -fsanitize=fuzzer-no-link $(PKG_CFLAGS) -c $< -o $@
build/fuzz/obj/%.o: %.c $(GEN)
	@./tools/install-deps.sh fuzz
	@mkdir -p $(@D)
	@echo "  FUZZCC  $<"
	@$(FUZZ_CC) -fsanitize=fuzzer-no-link $(PKG_CFLAGS) $(CFLAGS_HAVE) -MMD -MP -c $< -o $@
build/fuzz/fuzz_daemon: tests/fuzz/fuzz_daemon.c tests/procfd.c $(FUZZ_DAEMON_OBJ)
	@mkdir -p $(@D)
	@echo "  FUZZ    $@"
	@$(FUZZ_CC) -fsanitize=fuzzer $(PKG_CFLAGS) -o $@ $^ $(PKG_LIBS) -ldl -lm -lpthread
-include $(wildcard build/fuzz/obj/*/*.d)

fuzz: $(FUZZERS)
	@./tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZERS)

# The fuzzers built with $(CC) and a main that feeds them files: make test
# replays the corpus in tests/fuzz/corpus (under ASan+UBSan in test-asan).
FUZZ_REPLAYS := $(addprefix $(O)/fuzz-replay/,$(FUZZ_NAMES))
$(O)/fuzz-replay/%: tests/fuzz/%.c tests/fuzz/replay.c tests/procfd.c $(GPUDEV_LIBS) $(O)/lib/libcommon.a \
  $(DAEMON_OBJ)
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(PKG_CFLAGS) $(LDFLAGS) -o $@ $< tests/fuzz/replay.c tests/procfd.c \
	  $(filter-out $(O)/obj/daemon/main.o,$(DAEMON_OBJ)) $(GPUDEV_LIBS) $(O)/lib/libcommon.a \
	  $(PKG_LIBS) -ldl -lm -lpthread
.PHONY: fuzz-replay
fuzz-replay: $(FUZZ_REPLAYS)
	@for f in $(FUZZ_REPLAYS); do $$f tests/fuzz/corpus/$${f##*/} || exit 1; done

# Data races: not part of check (ThreadSanitizer is slow), run by hand.
test-tsan:
	@$(SUBMAKE_ENV) $(MAKE) --no-print-directory O=build/tsan SAN=thread test

# demo and check install what is missing, then build in a new make that
# sees what was installed.
# The HIP backend is also compiled against sid's ROCm headers, downloaded
# into the build tree (tools/fetch-rocm-headers.sh), next to the installed ones.
# Where the registry cannot serve sid, check says it skipped them; make
# check-hip-headers runs them on demand and fails where they cannot be had.
ROCM_SID := $(O)/rocm/sid
.PHONY: check-hip-headers
check: deps
	@$(SUBMAKE_ENV) $(MAKE) --no-print-directory test
	@./tools/fetch-rocm-headers.sh --optional $(ROCM_SID)
	@$(SUBMAKE_ENV) ./tests/build/check_hip_headers.sh /usr $(abspath $(ROCM_SID))/usr
	@$(SUBMAKE_ENV) ./tests/build/check_rebuild.sh
	@$(SUBMAKE_ENV) $(MAKE) --no-print-directory test-asan

check-hip-headers:
	@./tools/fetch-rocm-headers.sh $(ROCM_SID)
	@$(SUBMAKE_ENV) ./tests/build/check_hip_headers.sh /usr $(abspath $(ROCM_SID))/usr

demo: deps
	@$(SUBMAKE_ENV) $(MAKE) --no-print-directory all
	@./tools/demo.sh $(abspath $(O))

bench: all $(BENCHES)
	@./tools/install-deps.sh bench
	@./bench/run.sh $(abspath $(O))

# Installed programs carry no RUNPATH: gpumemctl and gpumem-worker are
# linked again without the build tree's $ORIGIN/../lib, and find
# libgpumem.so.1 through the system loader (ldconfig runs after an install
# as root without DESTDIR; LDCONFIG=: skips it). libgpumem_preload.so keeps
# its RUNPATH $ORIGIN: libgpumem.so.1 is installed next to it. gpumem.pc is
# written at install with the PREFIX, LIBDIR and INCLUDEDIR it is installed
# under. gpumem-worker, a test tool, goes to LIBEXECDIR/gpumemd, not BINDIR.
$(O)/inst/bin/%: tools/%.c $(O)/lib/libgpumem.so $(O)/lib/libcommon.a
	@mkdir -p $(@D)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< -L$(O)/lib -lgpumem $(O)/lib/libcommon.a \
	  $(shell pkg-config --libs libprotobuf-c) -ldl -lm

# Man pages: scdoc sources in man/, turned into roff in $(O)/man/ by `make`
# where scdoc is (make deps installs it; MAN=0 or MAN=1 to say), and
# installed by make install when built.
MAN ?= $(if $(shell command -v scdoc 2>/dev/null),1,0)
MANPAGES := $(patsubst man/%.scd,$(O)/man/%,$(wildcard man/*.scd))
.PHONY: man deb
ifeq ($(MAN),1)
all: $(MANPAGES)
endif
man: $(MANPAGES)
$(O)/man/%: man/%.scd
	@mkdir -p $(@D)
	@echo "  SCDOC   $<"
	@scdoc < $< > $@.tmp || { rm -f $@.tmp; exit 1; }
	@mv $@.tmp $@

# The units in systemd/ (wildcards: a timer may come), installed naming the
# installed programs, and the sysusers file that makes the socket's group.
UNITS := $(notdir $(wildcard systemd/*.service systemd/*.socket systemd/*.timer))
install_unit = sed -e 's|/usr/sbin/gpumemd|$(SBINDIR)/gpumemd|g' \
  -e 's|/usr/bin/gpumemctl|$(BINDIR)/gpumemctl|g' \
  -e 's|/usr/libexec/gpumemd/|$(LIBEXECDIR)/gpumemd/|g' systemd/$(1) > $(DESTDIR)$(SYSTEMDUNITDIR)/$(1)
man_path = $(MANDIR)/man$(subst .,,$(suffix $(1)))/$(notdir $(1))

INSTALLED := $(SBINDIR)/gpumemd $(BINDIR)/gpumemctl $(LIBEXECDIR)/gpumemd/gpumem-worker \
  $(LIBDIR)/libgpumem.so.1 $(LIBDIR)/libgpumem.so $(LIBDIR)/libgpumem_preload.so \
  $(PKGCONFIGDIR)/gpumem.pc $(INCLUDEDIR)/gpumem.h \
  $(addprefix $(SYSTEMDUNITDIR)/,$(UNITS)) $(SYSUSERSDIR)/gpumem.conf \
  $(foreach p,$(MANPAGES),$(call man_path,$(p)))

install: $(O)/bin/gpumemd $(INST_BINS) $(LIBS) $(if $(filter 1,$(MAN)),$(MANPAGES))
	install -d $(DESTDIR)$(SBINDIR) $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBEXECDIR)/gpumemd \
	  $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(INCLUDEDIR) \
	  $(DESTDIR)$(SYSTEMDUNITDIR) $(DESTDIR)$(SYSUSERSDIR)
	install -m 755 $(O)/bin/gpumemd $(DESTDIR)$(SBINDIR)/
	install -m 755 $(O)/inst/bin/gpumemctl $(DESTDIR)$(BINDIR)/
	install -m 755 $(O)/inst/bin/gpumem-worker $(DESTDIR)$(LIBEXECDIR)/gpumemd/
	install -m 755 $(O)/lib/libgpumem.so $(DESTDIR)$(LIBDIR)/libgpumem.so.1
	ln -sf libgpumem.so.1 $(DESTDIR)$(LIBDIR)/libgpumem.so
	install -m 755 $(O)/lib/libgpumem_preload.so $(DESTDIR)$(LIBDIR)/
	$(call make_pc) > $(DESTDIR)$(PKGCONFIGDIR)/gpumem.pc
	chmod 644 $(DESTDIR)$(PKGCONFIGDIR)/gpumem.pc
	install -m 644 include/gpumem.h $(DESTDIR)$(INCLUDEDIR)/
	$(foreach u,$(UNITS),$(call install_unit,$(u)) && chmod 644 $(DESTDIR)$(SYSTEMDUNITDIR)/$(u) && ) true
	install -m 644 systemd/gpumem.sysusers $(DESTDIR)$(SYSUSERSDIR)/gpumem.conf
ifeq ($(MAN),1)
	$(foreach p,$(MANPAGES),install -D -m 644 $(p) $(DESTDIR)$(call man_path,$(p)) && ) true
endif
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ]; then $(LDCONFIG) 2>/dev/null || true; fi

# Removes what install put, given the same PREFIX, LIBDIR... and DESTDIR.
uninstall:
	rm -f $(addprefix $(DESTDIR),$(INSTALLED))
	rmdir $(DESTDIR)$(LIBEXECDIR)/gpumemd 2>/dev/null || true
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ]; then $(LDCONFIG) 2>/dev/null || true; fi

# Debian packages gpumemd, libgpumem1, libgpumem-dev and python3-gpumem
# (debian/), built from a copy of the working tree (tracked and untracked
# files that git does not ignore) in build/deb/src: the .debs land in
# build/deb/, then lintian checks them. DEB_BUILD_OPTIONS=nocheck leaves
# out make test. The build sees the system's programs only (DEB_PATH): a
# python3 of pyenv or of an active venv first in PATH would otherwise be
# the one pybuild and make test run.
DEB_OUT := build/deb
DEB_PATH := /usr/sbin:/usr/bin:/sbin:/bin
deb:
	@./tools/install-deps.sh deb
	rm -rf $(DEB_OUT)
	mkdir -p $(DEB_OUT)/src
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
	  git ls-files -z --cached --others --exclude-standard | \
	    xargs -0 sh -c 'for f; do if [ -e "$$f" ] || [ -L "$$f" ]; then printf "%s\0" "$$f"; fi; done' sh | \
	    tar --null -T - -cf - | tar -xf - -C $(DEB_OUT)/src; \
	else tar --exclude=./build -cf - . | tar -xf - -C $(DEB_OUT)/src; fi
	cd $(DEB_OUT)/src && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u CFLAGS -u CPPFLAGS \
	  -u LDFLAGS -u VIRTUAL_ENV -u PYTHONPATH -u PYTHONHOME PATH=$(DEB_PATH) \
	  dpkg-buildpackage -us -uc -b -Jauto
	lintian $(DEB_OUT)/*.changes
	@ls -l $(DEB_OUT)/*.deb

clean:
	rm -rf build

-include $(shell find $(O)/obj -name '*.d' 2>/dev/null)
