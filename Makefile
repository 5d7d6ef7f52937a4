# `make demo` and `make test` do all their own setup: a .venv with shoal installed into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shoal-installed
# The Python that test-gpu runs: the venv's, or a GPU image's own with shoal already installed
# (`make test-gpu PY=python3` on an offline machine whose torch has CUDA: no venv is built).
PY     ?= $(BIN)/python
# Without an NVIDIA GPU, pin the CPU build of torch (a multi-GB CUDA build otherwise).
CONSTRAINTS := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)

.PHONY: demo test test-gpu lint docs install clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/shoal train --model lenet5 --dataset digits --workers 2 --epochs 10 --out runs/demo --overwrite

test: $(STAMP)
	$(BIN)/ruff check shoal tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/mkdocs build --strict --quiet -d build/site
	@# Byte-compiled once: the suite starts hundreds of interpreters, which would each compile
	@# shoal again where PYTHONDONTWRITEBYTECODE is set (as on this project's machines).
	$(BIN)/python -m compileall -q shoal tests
	@# Three test processes on two cores: many tests wait (heartbeat timeouts, held jobs);
	@# with two the machine idled 17% of the run (docs/performance-log.md).
	$(BIN)/python -m pytest -q -n 3 --dist load --durations=40

# On a machine with an NVIDIA GPU: what it is, every CUDA test (pytest -m gpu), then a short
# GPU benchmark (benchmarks/bench_gpu.py; its table in runs/bench-gpu/). Minutes in all.
test-gpu: $(if $(filter $(BIN)/python,$(PY)),$(STAMP))
	@$(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
		|| { echo "make test-gpu needs a CUDA GPU; none is visible" >&2; exit 1; }
	@if command -v nvidia-smi >/dev/null; then nvidia-smi; fi
	$(PY) benchmarks/bench_gpu.py --facts
	$(PY) -m pytest -m gpu -v
	$(PY) benchmarks/bench_gpu.py --out runs/bench-gpu

lint: $(STAMP)
	$(BIN)/ruff check shoal tests benchmarks examples
	$(BIN)/lint-imports

# The documentation site (docs/ and the API reference from the docstrings, mkdocs.yml) in
# build/site; warnings (a broken link or anchor, a docstring it cannot read) are errors.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict -d build/site

clean:
	rm -rf $(VENV) runs build *.egg-info
