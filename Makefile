# nbhd — set-up, build and tests. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CC ?= gcc
CFLAGS ?= -std=c11 -O2 -g -Wall -Wextra -fopenmp
BUILD := build/c
C_SRCS := $(wildcard csrc/core/*.c csrc/cpu/*.c)
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
$(BUILD)/libnbhd.so: $(C_SRCS) $(wildcard csrc/*/*.h csrc/include/*.h)
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS) -fPIC -shared $(C_INCS) $(C_SRCS) -o $@ -lm

$(BUILD)/%: csrc/tests/%.c $(BUILD)/libnbhd.so
	$(CC) $(CFLAGS) $(C_INCS) $< -o $@ -L$(BUILD) -lnbhd -Wl,-rpath,$(abspath $(BUILD)) -lm

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
