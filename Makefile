# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, install graphtune alone, run the main job (graphtune bench decode)
#   make test   create .venv, install graphtune with its test extras, check the house rules (format,
#               lint, types, a CPU smoke run) and run the CPU test suite
# TORCH_SPEC pins torch for this set-up only (the package itself asks for a range). The default is
# the CPU build that CI has on disk; on a CUDA machine use e.g. `make demo TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
TORCH_TAG := $(subst =,_,$(subst >,_,$(subst <,_,$(TORCH_SPEC))))
# The main job needs graphtune alone; the tests add their extras (pytest, ruff, mypy, hypothesis,
# transformers, matplotlib, triton) on top, in the same .venv.
STAMP := $(VENV)/.graphtune-$(TORCH_TAG)
TEST_STAMP := $(VENV)/.graphtune-test-$(TORCH_TAG)

.PHONY: demo test venv lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $(TEST_STAMP)

venv: $(TEST_STAMP)

# The main job: the decode benchmark on the best device present (llama-1b-shape with graphs on
# CUDA; the tiny preset eager-only on a CPU, where it says that graphs need CUDA).
demo: $(STAMP)
	$(VENV)/bin/graphtune bench decode

# The test command CI runs: house rules first (format, lint, types, a CPU smoke run of the main
# job), then the test suite in two pytest-xdist workers (CI has two cores, and much of the
# suite is single-threaded Python: the Triton interpreter, the CLI's subprocesses).
test: $(TEST_STAMP)
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	GRAPHTUNE_NO_PROGRESS=1 $(VENV)/bin/graphtune bench decode --model tiny --batch-sizes 1,4 \
		--steps 2 --repeats 1 > /dev/null
	$(PY) -m pytest -q -n 2 tests

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
