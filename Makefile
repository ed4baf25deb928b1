# The two commands of the README: `make demo` and `make test`. Both install what they need first.
PY ?= python3
# torch is put in place BEFORE the package, so pip never resolves `torch` to a multi-GB CUDA wheel on a
# CPU-only machine. On this project's machines torch==2.13.0 is a CPU build on local disk; elsewhere,
# e.g.: make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-test demo test test-gpu clean

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@$(PY) -m pip install -q -e .
	@# Triton runs kernels/ tests on the CPU (TRITON_INTERPRET=1); CUDA torch builds bring their own.
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==3.6.0

# The tests' extras on top (pytest, import-linter, and the trackers whose sinks the tests read back):
# the demo does not install them.
install-test: install
	@$(PY) -m pip install -q -e ".[test]"

demo: install
	megatrain train recipes/tiny.yaml

# The import rules first (pyproject.toml [tool.importlinter]: a violating import fails), then the tests.
test: install-test
	lint-imports
	$(PY) -m pytest -q

# On a machine with an NVIDIA GPU: the CUDA-marked tests only.
test-gpu: install-test
	$(PY) -m pytest -q -m cuda

clean:
	rm -rf runs build *.egg-info .pytest_cache
