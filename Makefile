# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Eight simulated CPU devices: the mesh of the tiny config (data 2 x stage 2 x tensor 2).
DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8
CONFIG ?= configs/tiny.py
WORKDIR ?= runs/tiny
DATA := data/default
SOURCES := kjv python_stdlib

.PHONY: setup data train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# The default corpus: each source exported to jsonl, one tokenizer trained on both, then each
# source preprocessed into its own .bin/.idx pair (configs/tiny.py blends them).
data: $(SOURCES:%=$(DATA)/%.idx)

$(DATA)/raw/.exported: $(VENV)/.installed launch/export_corpus.py mtnlg_jax/data/corpus.py
	$(PY) launch/export_corpus.py --out $(DATA)/raw
	touch $@

$(DATA)/tokenizer.model: $(DATA)/raw/.exported
	$(PY) launch/preprocess.py --input $(DATA)/raw --train-tokenizer --vocab-size 8192 \
		--tokenizer-model $@

$(DATA)/%.idx: $(DATA)/tokenizer.model launch/preprocess.py
	$(PY) launch/preprocess.py --input $(DATA)/raw/$*.jsonl --tokenizer-model $< \
		--output-prefix $(DATA)/$* --workers 2

# Training ends with the validation perplexity of the final checkpoint and a short sample.
train: data
	$(DEVICES) $(PY) launch/train.py --config $(CONFIG) --workdir $(WORKDIR)
	$(DEVICES) $(PY) launch/evaluate.py --workdir $(WORKDIR) --task perplexity \
		--data $(DATA)/kjv --split valid --max_tokens 16384
	$(DEVICES) $(PY) launch/generate.py --workdir $(WORKDIR) --prompt "In the beginning" \
		--max_new_tokens 40

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile  # two workers: the CI machine has 2 cores

bench: setup
	$(PY) bench/throughput.py
	$(PY) bench/pipeline.py
	$(PY) bench/generate.py
	$(PY) bench/checkpoint.py

clean:
	rm -rf $(VENV) $(DATA) runs
