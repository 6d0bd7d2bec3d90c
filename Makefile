# nbhd — set-up, build and tests. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CC ?= gcc
CFLAGS ?= -std=c11 -O3 -g -Wall -Wextra -Wno-psabi -fopenmp
BUILD := build/c
C_SRCS := $(wildcard csrc/core/*.c csrc/cpu/*.c csrc/cpu/fast/*.c csrc/cpu/amx/*.c csrc/cpu/scalar/*.c)
C_INCS := -Icsrc/include -Icsrc/core -Icsrc/cpu

.PHONY: all venv install demo test test-c test-py bench-cpu clean

all: install

# torch is pinned to the build this machine carries, so no range can pull another one.
$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q pytest numpy expecttest hypothesis tqdm matplotlib
	touch $@

venv: $(VENV)/.ready

install: venv
	$(PIP) install -q --no-build-isolation -e .

demo: install
	$(PY) examples/demo.py

# ---- C library on its own (no Python) ------------------------------------
# one object per source, so `make -j` compiles them side by side
C_HEADERS := $(wildcard csrc/*/*.h csrc/*/*/*.h csrc/include/*.h)
C_OBJS := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(C_SRCS))
$(BUILD)/obj/%.o: csrc/%.c $(C_HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fPIC $(C_INCS) -c $< -o $@

$(BUILD)/libnbhd.so: $(C_OBJS)
	$(CC) $(CFLAGS) -fPIC -shared $(C_OBJS) -o $@ -lm

# a C program on the library and csrc/tests/harness.h
LINK_C_PROGRAM = $(CC) $(CFLAGS) $(C_INCS) -Icsrc/tests $< -o $@ -L$(BUILD) -lnbhd -Wl,-rpath,$(abspath $(BUILD)) -lm

$(BUILD)/%: csrc/tests/%.c $(BUILD)/libnbhd.so
	$(LINK_C_PROGRAM)

# instruction counts of one kernel call under callgrind (bench/count_cpu.c says how)
$(BUILD)/count_cpu: bench/count_cpu.c $(BUILD)/libnbhd.so
	$(LINK_C_PROGRAM)

C_TESTS := $(patsubst csrc/tests/%.c,$(BUILD)/%,$(wildcard csrc/tests/test_*.c))

test-c: $(C_TESTS)
	@set -e; for t in $(C_TESTS); do echo "== $$t"; $$t; done

test-py: install
	$(PY) -m pytest -q tests

test: test-c test-py

bench-cpu: install
	$(PY) bench/bench_cpu.py

clean:
	rm -rf build $(VENV) nbhd/_nbhd*.so *.egg-info

# ---- sanitizers, fuzzing, valgrind ------------------------------------------
# test-c-sanitized: every C test with the library compiled in, under ASan + UBSan (gcc).
# test-py-sanitized: the fuzz test of the custom ops, Python on the sanitized library.
# fuzz-smoke: libFuzzer (clang) on the public API for FUZZ_SECONDS, from the seed corpus
#   csrc/tests/fuzz_corpus/ (new inputs go to build/fuzz/corpus, crashes to build/fuzz/).
# valgrind-c: one C test under valgrind's memcheck (no leaks, no invalid access).
SAN_BUILD := build/c-san
FUZZ_BUILD := build/fuzz
CLANG ?= clang
FUZZ_SECONDS ?= 60
FUZZ_SEED ?= 1  # fixed in CI so a run is repeatable; `make fuzz-smoke FUZZ_SEED=0` picks one
FUZZ_RUNS ?= 10000  # with the seed: the same inputs on every machine (max_total_time caps slow ones)
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
C_TEST_HEADERS := $(wildcard csrc/tests/*.h) csrc/tests/fuzz_api.c
SAN_C_TESTS := $(patsubst csrc/tests/%.c,$(SAN_BUILD)/%,$(wildcard csrc/tests/test_*.c))

.PHONY: test-c-sanitized test-py-sanitized fuzz-smoke fuzz-build valgrind-c ci-tools

# CI machines start bare: clang (libFuzzer) and valgrind from apt when missing
ci-tools:
	@need=""; command -v $(CLANG) >/dev/null || need="$$need clang"; \
	command -v valgrind >/dev/null || need="$$need valgrind"; \
	if [ -n "$$need" ]; then s=""; [ "$$(id -u)" = 0 ] || s=sudo; \
		echo "installing$$need"; $$s apt-get update -qq && $$s apt-get install -y -qq $$need >/dev/null; fi

$(C_TESTS): $(C_TEST_HEADERS)

# the library's objects are compiled once, then linked into each test
SAN_OBJS := $(patsubst csrc/%.c,build/c-san-obj/%.o,$(C_SRCS))
.SECONDARY: $(SAN_OBJS)
# The portable fast kernels (fast/generic.c: 16-lane vectors as arrays, register-blocked) take
# the compilers 5-15 minutes to optimise under ASan+UBSan; at -O0 they keep every check and
# compile in under a minute.
SAN_OPT := -O1
build/c-san-obj/cpu/fast/generic.o: SAN_OPT := -O0
build/c-san-obj/%.o: csrc/%.c $(C_HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SAN_OPT) $(SAN_FLAGS) -fPIC $(C_INCS) -c $< -o $@

$(SAN_BUILD)/%: csrc/tests/%.c $(SAN_OBJS) $(C_TEST_HEADERS)
	@mkdir -p $(SAN_BUILD)
	$(CC) $(CFLAGS) -O1 $(SAN_FLAGS) $(C_INCS) $< $(SAN_OBJS) -o $@ -lm

# the same objects as a shared library, for Python with the ASan runtime preloaded
$(SAN_BUILD)/libnbhd.so: $(SAN_OBJS)
	@mkdir -p $(SAN_BUILD)
	$(CC) $(CFLAGS) $(SAN_FLAGS) -shared $(SAN_OBJS) -o $@ -lm

# test-py-sanitized: the custom-op fuzz test (tests/test_op_fuzz.py) on that library, under
# ASan + UBSan (leak checks off: CPython and torch keep their allocations until exit; -s: a
# sanitizer report goes to the terminal, not to a capture the abort discards)
test-py-sanitized: $(SAN_BUILD)/libnbhd.so venv
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		NBHD_LIBRARY=$(abspath $(SAN_BUILD)/libnbhd.so) PYTHONPATH=$(CURDIR) \
		$(PY) -m pytest -q -s -p no:cacheprovider tests/test_op_fuzz.py

test-c-sanitized: $(SAN_C_TESTS)
	@set -e; for t in $(SAN_C_TESTS); do echo "== $$t (ASan+UBSan)"; $(SAN_ENV) $$t; done
	@set -e; for isa in avx2 generic; do echo "== fast kernels forced to $$isa (ASan+UBSan)"; \
		NBHD_CPU_ISA=$$isa $(SAN_ENV) $(SAN_BUILD)/test_fuzz_corpus; \
		NBHD_CPU_ISA=$$isa $(SAN_ENV) $(SAN_BUILD)/test_kernels 60 1000; done

FUZZ_FLAGS := -std=c11 -g -Wno-psabi -fsanitize=address,undefined -fno-sanitize-recover=undefined $(C_INCS)
$(FUZZ_BUILD)/fast_generic.o: csrc/cpu/fast/generic.c $(C_HEADERS)
	@mkdir -p $(FUZZ_BUILD)
	$(CLANG) $(FUZZ_FLAGS) -O0 -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_BUILD)/fuzz_api: csrc/tests/fuzz_api.c $(FUZZ_BUILD)/fast_generic.o $(C_SRCS) $(C_TEST_HEADERS) $(C_HEADERS)
	@mkdir -p $(FUZZ_BUILD)/corpus
	$(CLANG) $(FUZZ_FLAGS) -O1 -fsanitize=fuzzer $< $(filter-out csrc/cpu/fast/generic.c,$(C_SRCS)) \
		$(FUZZ_BUILD)/fast_generic.o -o $@ -lm

fuzz-build: $(FUZZ_BUILD)/fuzz_api

fuzz-smoke: $(FUZZ_BUILD)/fuzz_api
	$(SAN_ENV) $(FUZZ_BUILD)/fuzz_api -seed=$(FUZZ_SEED) -runs=$(FUZZ_RUNS) -max_total_time=$(FUZZ_SECONDS) -timeout=20 -max_len=512 \
		-rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/ \
		$(FUZZ_BUILD)/corpus csrc/tests/fuzz_corpus

valgrind-c: $(BUILD)/test_validate $(BUILD)/test_kernels
	valgrind --leak-check=full --errors-for-leak-kinds=definite,indirect --error-exitcode=1 -q \
		$(BUILD)/test_validate
	OMP_NUM_THREADS=2 valgrind --leak-check=full --errors-for-leak-kinds=definite,indirect --error-exitcode=1 -q \
		$(BUILD)/test_kernels 40
