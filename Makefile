# impasto — the two commands a fresh machine needs: `make run` and `make test`.
PY ?= python3
PROMPT ?= Write a haiku about paint.

.PHONY: install run test lint format bench

install:
	# torch is pinned to the CPU build: an unpinned install pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'

run: install
	$(PY) -m impasto.entrypoints.cli generate "$(PROMPT)" "What is the capital of France?"

lint:
	$(PY) -m ruff check impasto tests benchmarks
	$(PY) -m ruff format --check impasto tests benchmarks
	# the layering (pyproject.toml [tool.importlinter]) and the types of the core layers
	$(PY) -c "from importlinter.cli import lint_imports_command; lint_imports_command()"
	$(PY) -m mypy

test: install lint
	$(PY) -m pytest -q -p no:cacheprovider

format:
	$(PY) -m ruff format impasto tests benchmarks
	$(PY) -m ruff check --fix impasto tests benchmarks

bench: install
	$(PY) benchmarks/scheduler_overhead.py
