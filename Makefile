# The commands the README uses.  Everything runs from a virtual environment
# in .venv that `make setup` creates (and every other target creates on demand).
PYTHON ?= python3
VENV ?= .venv
ARCH ?= sm80
# Targets packed into `make wheel` (FLASHGEN_KERNELS=glob and FLASHGEN_PTX=1 are honoured too).
ARCHS ?= sm80,sm90a
BIN := $(VENV)/bin

.PHONY: setup generate check build test wheel clean

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

# The same PEP 517 build cibuildwheel runs, without containers: dist/flashgen-*.whl
wheel: setup
	FLASHGEN_ARCHS=$(ARCHS) $(BIN)/python -m pip wheel --no-deps --wheel-dir dist .
	ls -l dist/*.whl

clean:
	rm -rf build dist
