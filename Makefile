# The two commands: `make demo` and `make test`. Each installs what is missing first.
# Installing never pulls a CUDA build of torch onto a machine without a GPU: when torch is
# missing we ask for the pinned CPU build ($(TORCH_CPU)); with a GPU, pip's default build.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_CPU ?= torch==2.13.0
STAMP := build/.install-stamp
SOURCES := pyproject.toml setup.py $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' 2>/dev/null)

.PHONY: install demo test lint bench-cpu clean

$(STAMP): $(SOURCES)
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then $(PIP) install torch; \
	  else $(PIP) install "$(TORCH_CPU)"; fi; }
	$(PIP) install "setuptools>=64" wheel
	$(PIP) install --no-build-isolation -e ".[test,demo,hf]"
	@mkdir -p build && touch $@

install: $(STAMP)

demo: install
	$(PYTHON) examples/train_gpt.py

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# One pytest worker per core (pytest-xdist, a test extra); idle workers take queued tests.
# pytest-benchmark, where a machine has it, warns once per worker that xdist disables it.
PYTEST_WORKERS ?= auto
PYTEST := $(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -p no:benchmark

# --durations=30: the 30 slowest tests, above the result line.
test: install lint
	$(PYTEST) --durations=30 tests
	@# Triton kernels on the CPU through Triton's interpreter (tests marked `triton`, all in
	@# tests/kernels: tests/test_suite_layout.py checks it); exit code 5 means none are
	@# collected, which is not a failure.
	TRITON_INTERPRET=1 $(PYTEST) -m triton tests/kernels || [ $$? -eq 5 ]

bench-cpu: install
	$(PYTHON) -m bench.bench_linear --smoke
	$(PYTHON) -m bench.bench_overhead --smoke

clean:
	rm -rf build te_compile/*.so *.egg-info
