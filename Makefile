# The two commands of the README: `make rl` (the main job) and `make test` (the tests); `make docs`
# regenerates the key reference of docs/configuration.md.
# Both create or update .venv on their own, keyed on a stamp file.
PY ?= python3.11

# Each module is compiled to a .pyc file by its first import, and later imports load it, even where the shell sets
# PYTHONDONTWRITEBYTECODE (then every process would compile all it imports, again and again): what runs imports a
# small part of the venv's files, so compiling all of them at install costs more than it saves.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
STAMP := $(VENV)/.stamp
BIN := $(VENV)/bin

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile --upgrade pip
	# torch first, pinned: the local CPU wheel; a looser spec could pull a CUDA build.
	$(BIN)/pip install -q --no-compile -c constraints.txt torch
	$(BIN)/pip install -q --no-compile -c constraints.txt -e '.[dev,verifiers]'
	touch $(STAMP)

.PHONY: venv rl test docs
venv: $(STAMP)

rl: $(STAMP)
	$(BIN)/tandem rl @ examples/reverse_text/rl.toml --clean

# Two workers (CI's two cores), each module on one of them, modules with slow tests handed out first
# (tests/conftest.py says how they share the cores).
test: $(STAMP)
	$(BIN)/python -m pytest -q -x -n 2 --dist loadscope --no-loadscope-reorder tests

docs: $(STAMP)
	$(BIN)/python -m tandem.config.reference
