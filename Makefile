# The README's two commands: `make demo` (the main job) and `make test` (the tests).
# Each sets itself up on a fresh machine and is safe to rerun.
PY := .venv/bin/python

.PHONY: setup demo demo-single test test-asan test-rdma test-torch test-torchtitan build bench bench-compare bench-programs gpu-check
setup:
	@bash scripts/setup_env.sh

build: setup

# The heterogeneous pipeline: profile chips, plan, train over them, check against a CPU reference.
demo: setup
	$(PY) examples/hetero_demo.py $(DEMO_ARGS)

# One emulated chip against the CPU (the device layer alone).
demo-single: setup
	$(PY) examples/train_llama.py $(DEMO_ARGS)

# Four pytest-xdist workers by default on 2 cores: the suite's tests spend much of their time
# waiting (rank processes starting, sockets, timeouts); with four the cores were busy 137% of a
# core on average (8m49s on a fresh clone on 2 cores with nothing else running), with three 121%
# and with two 111% (earlier trees). Tests marked slow start first (tests/conftest.py). Test ranks fork from a process that has
# imported torch (tests/forked_ranks.py).
# TEST_WORKERS=0 runs it in one process. The 15 slowest tests in wall time and the 15 that used
# the most CPU (the suite's real cost on 2 shared cores: tests/cpu_time.py) are listed at the end.
# TEST_BUSY=N runs the suite beside N busy processes (tests/conftest.py): the loaded machine.
# Each test's worker, start, end, wall and CPU time go to $(TEST_TIMELINE), with each worker's busy
# time and the run's tail printed (tests/timeline.py).
TEST_WORKERS ?= 4
TEST_BUSY ?= 0
TEST_TIMELINE ?= build/test_timeline.jsonl
export TEST_WORKERS
test: setup
	GLOO_SOCKET_IFNAME=lo DITORCH_TEST_BUSY=$(TEST_BUSY) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=15 --cpu-durations=15 --timeline=$(TEST_TIMELINE) tests $(TEST_ARGS)

# tests/comm and tests/device against sanitized (ASan + UBSan) builds, then the frame fuzzer: scripts/test_asan.sh.
test-asan: setup
	bash scripts/test_asan.sh $(TEST_ARGS)

# ditorch against another torch release (TORCH=X.Y.Z, e.g. 2.11.0 or 2.15.0): a venv of its own with that
# torch from the package index (the CUDA build: gigabytes), a copy of the tree built against it
# under build/torch-X.Y.Z, then a subset of the tests that reaches every layer: scripts/test_torch.sh.
# Not in .ci/run: the download and a one-job build take longer than its budget (docs/device.md).
test-torch:
	TORCH=$(TORCH) bash scripts/test_torch.sh

# torchtitan 0.3.0 (PyTorch's LLM trainer, unchanged) trains its llama3 debug model on dipu over
# dicomm: FSDP2, TP, PP schedules, HSDP, activation checkpointing, torch.compile, a distributed
# checkpoint moved between dipu and the CPU, bf16, mixed chips and vendors, each against the CPU
# over gloo (tests/ecosystem). It needs torch 2.14 (TORCH=X.Y.Z, default 2.14.1): the venv and
# build of `make test-torch`, then torchtitan beside it: scripts/test_torchtitan.sh.
test-torchtitan:
	TORCH=$(or $(TORCH),2.14.1) bash scripts/test_torchtitan.sh

# The rdma tests on real (soft-RoCE) verbs, inside a qemu guest: see docs/rdma.md.
test-rdma: setup
	bash scripts/rdma_vm/run_tests.sh $(TEST_ARGS)

# The dipu device on a real GPU (scripts/gpu_check.py, at most 8 minutes): build against the torch
# installed there, the device tests, training and two ranks on dipu over cuda, the mixed-vendor
# pipeline and dipu/cuda micro-benchmarks; the table goes into docs/device.md. No set-up step: a
# GPU machine may have no network, so it uses its own python and torch (GPU_PYTHON).
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# The micro-benchmarks (pytest-benchmark, benchmarks/micro): each group times a contender beside
# its peer (CPU, gloo, exhaustive search) in the same run. `bench` saves the run under
# $(BENCH_STORAGE) and writes $(BENCH_REPORT), and the marked blocks of the pages in $(BENCH_DOCS),
# from the saved runs (benchmarks/report.py).
# `bench-compare` runs them again and fails when one regressed against the last saved run: its
# median over rounds more than $(BENCH_FAIL) slower (the minimum is one lucky round: an
# unchanged build's one-element CPU add had a minimum of 1.20 us in one run and 1.99 us in the
# next, medians 2.18 and 2.22 us), or $(BENCH_FAIL_TWO_RANKS) for the two-rank benchmarks: with
# two ranks and their transport threads on two shared cores, an unchanged build's 1 MiB
# allreduce takes 0.29 ms in one run and 0.98 ms in the next (steady within each run), so only
# a 4x change is a signal. Then each benchmark program's latest
# saved run is held against its previous one by $(BENCH_FAIL).
BENCH ?= benchmarks/micro
BENCH_STORAGE ?= .benchmarks
BENCH_FAIL ?= median:50%
BENCH_FAIL_TWO_RANKS ?= median:300%
BENCH_REPORT ?= docs/benchmarks.md
BENCH_DOCS ?= docs
BENCH_PYTEST = $(PY) -m pytest $(BENCH) --benchmark-storage=$(BENCH_STORAGE)
bench: setup
	$(BENCH_PYTEST) --benchmark-autosave $(BENCH_ARGS)
	$(PY) benchmarks/report.py --storage $(BENCH_STORAGE) --out $(BENCH_REPORT) --docs "$(BENCH_DOCS)"

bench-compare: setup
	$(BENCH_PYTEST) -m "not two_ranks" --benchmark-compare --benchmark-compare-fail=$(BENCH_FAIL) $(BENCH_ARGS) \
	  || [ $$? = 5 ]
	$(BENCH_PYTEST) -m two_ranks --benchmark-compare --benchmark-compare-fail=$(BENCH_FAIL_TWO_RANKS) $(BENCH_ARGS) \
	  || [ $$? = 5 ]  # 5: no two-rank benchmark selected (BENCH names others)
	DITORCH_BENCH_STORAGE=$(BENCH_STORAGE) $(PY) benchmarks/program_results.py compare --fail $(BENCH_FAIL)

# The system-level benchmark programs (minutes each), each saving its run under
# $(BENCH_STORAGE)/programs in pytest-benchmark's form; comm_builds.py compares two builds and
# needs the baseline's path.
bench-programs: setup
	for b in benchmarks/*.py; do case $$b in benchmarks/comm_builds.py|benchmarks/program_results.py|benchmarks/report.py|benchmarks/emulated_chips.py) continue;; esac; \
	  DITORCH_BENCH_STORAGE=$(BENCH_STORAGE) $(PY) $$b || exit 1; done
