# Two commands do all set-up on a fresh machine:
#   make demo   -- the main job: the toy transformer through the pipeline, on CPU
#   make test   -- the test suite (CPU; GPU tests skip without a GPU)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13.0 (a newer torch would pull a multi-GB CUDA build).
TORCH ?= torch==2.13.0

.PHONY: install demo test test-all fuzz lint gpu-test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: install
	$(BIN)/shapewise demo

test: install
	$(BIN)/python -m pytest -q -n auto --dist worksteal --durations=60

fuzz: install
	$(BIN)/python -m pytest -q -m fuzz

# ruff, and the layer contracts of pyproject.toml (import-linter; lazy imports count).
lint: install
	$(BIN)/ruff check shapewise tests benchmarks examples
	$(BIN)/lint-imports

# On the GPU machine (torch preinstalled, no network): run the checkout in place.
gpu-test:
	PYTHONPATH=. python3 -m pytest -q -m "(gpu or inductor) and not fuzz" -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
