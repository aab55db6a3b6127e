# Everything installs into .venv; nothing needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NRANKS ?= 2

.PHONY: bench test test-quick peers matrix install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,mpi,plot,torch]'
	touch $(STAMP)

install: $(STAMP)

# Main job: a local multi-rank benchmark on the default planes (up = shared
# memory, out = tcp), every path policy side by side, per-plane bandwidth.
bench: $(STAMP)
	$(VENV)/bin/mpccs-run -n $(NRANKS) $(VENV)/bin/mpccs-perf all_reduce -b 1K -e 64M -f 4 -n 10 -w 3 --compare --settle 40

# The test suite (CI runs exactly this).
test: $(STAMP)
	@if [ -f scripts/install-system-deps.sh ]; then bash scripts/install-system-deps.sh; fi
	$(PY) -m pytest -q -ra

test-quick: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow and not root"

clean:
	rm -rf $(VENV) build *.egg-info
