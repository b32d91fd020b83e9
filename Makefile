# Two entry points for a newcomer: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
REQUIREMENTS ?= requirements-cpu.txt
TORCHREC_VERSION ?= 1.8.0
BIN := $(VENV)/bin
NPROC ?= 2

.PHONY: venv test demo bench clean

venv: $(VENV)/.installed

# Re-installs only when the requirements or setup.py change.
$(VENV)/.installed: $(REQUIREMENTS) setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r $(REQUIREMENTS)
	$(BIN)/python -m pip install --quiet --no-deps torchrec==$(TORCHREC_VERSION)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test: venv
	$(BIN)/python -m pytest -q tests

demo: venv
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) examples/dlrm_torchrun.py --planner neuroshard,torchrec

bench: venv
	$(BIN)/python -m benchmarks.compare

clean:
	rm -rf $(VENV) *.egg-info
