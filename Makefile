# Set-up is part of every target: a fresh clone needs only `make run` or `make test`.
# torch is pinned to the 2.13.0 CPU build, which installs offline on CPU machines; on a GPU
# machine run `make venv TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`
# (or install your CUDA build of torch into .venv first) and the pin is satisfied as is.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: venv run test lint docs pytest clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test,docs]"
	touch $(STAMP)

run: venv
	$(BIN)/python recipes/train.py $(ARGS)

lint: venv
	$(BIN)/ruff check src tests recipes
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site, built strict (any warning fails); the site lands in build/site.
# NO_MKDOCS_2_WARNING silences mkdocs-material's banner about its end of life (not a warning).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

pytest: venv
	$(BIN)/python -m pytest -q $(ARGS)

test: lint docs pytest

clean:
	rm -rf $(VENV) outputs .pytest_cache .mypy_cache .ruff_cache
