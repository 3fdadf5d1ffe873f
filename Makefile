# hvd_sparse: `make demo` and `make test` each set up everything they need (idempotently) in .venv/.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 2
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# TensorFlow (imported by horovodrun) logs a page of CPU-feature notes otherwise.
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Horovod's launcher, quiet about the machine's missing MPI; Gloo over the loopback interface.
HOROVODRUN := $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo
# TensorFlow's start-up lines (every rank's and horovodrun's own) filtered out; HVD_SPARSE_VERBOSE=1 keeps them.
QUIET := $(PY) -m hvd_sparse.quiet

.PHONY: venv test test-fast demo check-build clean

venv:
	@bash scripts/setup_env.sh

test: venv
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q -m "not horovod" tests

demo: venv
	$(QUIET) $(HOROVODRUN) $(PY) examples/pytorch_digits.py
	$(QUIET) $(HOROVODRUN) $(PY) examples/keras_digits.py --compression oktopk --density 0.01

check-build: venv
	$(VENV)/bin/horovodrun --check-build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
