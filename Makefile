# `make run`  : build a virtualenv from nothing, then run the sample job on the default model.
# `make test` : build a virtualenv from nothing (with test extras), then run the whole test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
OUT    ?= out

.PHONY: run test venv venv-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=68" wheel

venv: $(BIN)/python
	$(BIN)/python -m pip install -q -e .

venv-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test]"

run: venv
	mkdir -p $(OUT)
	$(BIN)/offline-paged generate data/prompts.jsonl -o $(OUT)/completions.jsonl --stats-json $(OUT)/stats.json

test: venv-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info
