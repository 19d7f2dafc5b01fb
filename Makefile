# The commands the README uses.  Everything runs from a virtual environment
# in .venv that `make setup` creates (and every other target creates on demand).
PYTHON ?= python3
VENV ?= .venv
ARCH ?= sm80
BIN := $(VENV)/bin

.PHONY: setup generate check build test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[build,test]'
	touch $@

generate: setup
	$(BIN)/flashgen generate

check: setup
	$(BIN)/flashgen generate --check

build: setup
	$(BIN)/flashgen build --arch $(ARCH)

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf build
