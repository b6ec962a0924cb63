# The README's two commands: `make demo` (the main job) and `make test` (the tests).
# Each sets itself up on a fresh machine and is safe to rerun.
PY := .venv/bin/python

.PHONY: setup demo test test-rdma build bench
setup:
	@bash scripts/setup_env.sh

build: setup

demo: setup
	$(PY) examples/train_llama.py $(DEMO_ARGS)

test: setup
	GLOO_SOCKET_IFNAME=lo $(PY) -m pytest -q tests $(TEST_ARGS)

# The rdma tests on real (soft-RoCE) verbs, inside a qemu guest: see docs/rdma.md.
test-rdma: setup
	bash scripts/rdma_vm/run_tests.sh $(TEST_ARGS)

bench: setup
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done
