# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Eight simulated CPU devices: the mesh of the tiny config (data 4 x stage 1 x tensor 2).
DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8
CONFIG ?= configs/tiny.py
WORKDIR ?= runs/tiny
DATA := data/default

.PHONY: setup data train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

data: setup
	$(PY) launch/prepare_data.py --out $(DATA)

train: data
	$(DEVICES) $(PY) launch/train.py --config $(CONFIG) --workdir $(WORKDIR)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/throughput.py
	$(PY) bench/checkpoint.py

clean:
	rm -rf $(VENV) $(DATA) runs
