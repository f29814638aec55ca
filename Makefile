# `make demo` and `make test` do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.atom-plugin-installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV)

demo: $(STAMP)
	$(PY) -m scripts.demo

lint: $(STAMP)
	$(PY) -m ruff check atom_plugin tests benchmarks scripts
	$(PY) -m ruff format --check atom_plugin tests benchmarks scripts

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=20

clean:
	rm -rf $(VENV) .demo
