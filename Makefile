# `make demo` and `make test` work on a fresh machine: both create .venv through `make setup`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test notebooks clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@interpreter=$$(sh scripts/find_python.sh) && echo "creating $(VENV) with $$interpreter" && \
		"$$interpreter" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	@touch $@

demo: setup
	$(PY) -m k3jax demo

test: setup
	$(PY) -m pytest -n 2 --dist loadfile -q

notebooks: setup
	$(PY) notebooks/build.py

clean:
	rm -rf $(VENV)
