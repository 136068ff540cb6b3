# The two commands of the README. Both do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel of torch lies on this machine's disk; an unpinned torch would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-fast setup

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]"

demo: setup
	$(PY) -m zorse_lightning.cluster cluster=cpu_sim4
	$(PY) -m zorse_lightning.train recipe=gpt_tiny_cpu_sim4

test: setup
	$(PY) -m pytest -q

# The single-process part alone (planner, profiles, emulation, schedules): seconds.
test-fast: setup
	$(PY) -m pytest -q -m "not multiprocess"
