# The README's two commands: `make demo` (the main job) and `make test` (the tests).
# Each sets itself up on a fresh machine and is safe to rerun.
PY := .venv/bin/python

.PHONY: setup demo demo-single test test-asan test-rdma build bench bench-compare bench-programs
setup:
	@bash scripts/setup_env.sh

build: setup

# The heterogeneous pipeline: profile chips, plan, train over them, check against a CPU reference.
demo: setup
	$(PY) examples/hetero_demo.py $(DEMO_ARGS)

# One emulated chip against the CPU (the device layer alone).
demo-single: setup
	$(PY) examples/train_llama.py $(DEMO_ARGS)

test: setup
	GLOO_SOCKET_IFNAME=lo $(PY) -m pytest -q tests $(TEST_ARGS)

# tests/comm against a sanitized (ASan + UBSan) dicomm, then the frame fuzzer: scripts/test_asan.sh.
test-asan: setup
	bash scripts/test_asan.sh $(TEST_ARGS)

# The rdma tests on real (soft-RoCE) verbs, inside a qemu guest: see docs/rdma.md.
test-rdma: setup
	bash scripts/rdma_vm/run_tests.sh $(TEST_ARGS)

# The micro-benchmarks (pytest-benchmark, benchmarks/micro): each group times a contender beside
# its peer (CPU, gloo, exhaustive search) in the same run. `bench` saves the run under
# $(BENCH_STORAGE); `bench-compare` runs them again and fails when a benchmark regressed against
# the last saved run by more than $(BENCH_FAIL): the minimum of its rounds (the statistic least
# moved by other load on a shared machine) more than 25% slower.
BENCH ?= benchmarks/micro
BENCH_STORAGE ?= .benchmarks
BENCH_FAIL ?= min:25%
bench: setup
	$(PY) -m pytest $(BENCH) --benchmark-storage=$(BENCH_STORAGE) --benchmark-autosave $(BENCH_ARGS)

bench-compare: setup
	$(PY) -m pytest $(BENCH) --benchmark-storage=$(BENCH_STORAGE) --benchmark-compare \
	  --benchmark-compare-fail=$(BENCH_FAIL) $(BENCH_ARGS)

# The system-level benchmark programs (minutes each); comm_builds.py compares two builds and
# needs the baseline's path.
bench-programs: setup
	for b in benchmarks/*.py; do [ $$b = benchmarks/comm_builds.py ] || $(PY) $$b || exit 1; done
