# impasto — the two commands a fresh machine needs: `make run` and `make test`.
PY ?= python3
PROMPT ?= Write a haiku about paint.
LOCK := requirements/lock.txt
PIP_LOCK := requirements/pip-lock.txt
PIP := $(PY) -m pip --quiet --disable-pip-version-check

.PHONY: install run test lint format bench lock test-latest

install:
	# Every dependency from the committed lock: exact versions, checked against their hashes
	# (torch is the CPU build). pip itself first, from the same lock (a fresh virtualenv's pip
	# refuses the lock's extras of transitive dependencies). Then impasto itself, which adds
	# nothing unlocked.
	$(PIP) install --require-hashes -r $(PIP_LOCK)
	$(PIP) install --require-hashes -r $(LOCK)
	$(PIP) install --no-deps --no-build-isolation -e .

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

lock:
	# Refresh the lock from pyproject.toml and requirements/lock-inputs.txt (newest releases
	# that satisfy them), with hashes. Commit the result after `make test` passes on it.
	$(PIP) install pip-tools
	$(PY) -m piptools compile --quiet --generate-hashes --allow-unsafe \
		--no-emit-index-url --no-emit-find-links --extra test --extra ray -o $(LOCK) \
		pyproject.toml requirements/lock-inputs.txt
	# pip's own pin and hashes, as the first step of `make install` reads them
	$(PY) -c "import re, sys; t = open('$(LOCK)').read(); \
		m = re.search(r'^pip==.*?(?=^\S)', t, re.M | re.S); \
		open('$(PIP_LOCK)', 'w').write('# pip, from $(LOCK) (make lock)\n' + m.group(0))"

test-latest:
	# Not in CI: the suite against the newest releases pyproject.toml allows, in a fresh
	# virtualenv, to see dependency drift before it reaches the lock.
	rm -rf .venv-latest
	$(PY) -m venv .venv-latest
	.venv-latest/bin/python -m pip install --quiet torch==2.13.0
	.venv-latest/bin/python -m pip install --quiet --upgrade -e '.[test]'
	$(MAKE) lint PY=.venv-latest/bin/python
	.venv-latest/bin/python -m pytest -q -p no:cacheprovider
