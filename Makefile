# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Eight simulated CPU devices: the mesh of the tiny config (data 2 x stage 2 x tensor 2).
DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8
CONFIG ?= configs/tiny.py
# Each config its own workdir: runs/tiny, runs/tiny_llama, ...
WORKDIR ?= runs/$(basename $(notdir $(CONFIG)))
DATA := data/default
SOURCES := kjv python_stdlib

.PHONY: setup dev gpu-compile gpu-check data train train-multiprocess test lint bench clean

setup: $(VENV)/.installed
dev: $(VENV)/.dev-installed  # setup + the pinned developer tools (pytest, ruff)

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The XLA:GPU compiler, to compile GPU steps on a machine without a GPU (launch/plan.py
# --target a100-80gb | h100-80gb): requirements-gpu-compile.txt, about 2.3 GB, in a folder of
# its own (mtnlg_jax/xla/gpu_compile.py says why). With it, make test also runs
# tests/test_gpu_compile.py (skipped without it).
gpu-compile: .gpu-compile/.installed

.gpu-compile/.installed: $(VENV)/.installed requirements-gpu-compile.txt
	$(PY) -m pip install --quiet --no-deps --upgrade --target .gpu-compile \
		-r requirements-gpu-compile.txt
	touch $@

# Everything on the first GPU machine, on the JAX it carries (not our pinned venv: GPU images
# bring their own jax and CUDA plugin): kernels against the reference and cuDNN, their speed,
# a ~2 B model's step, memory, the HLO checks, a profile. Needs only pure-Python extras
# (bench/gpu_check.py names any missing); exits 2 with one line on a machine without a GPU.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= runs/gpu_check
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=.:$(PYTHONPATH) $(GPU_PYTHON) bench/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# The default corpus: each source exported to jsonl and curated (launch/curate.py: exact and
# fuzzy deduplication; DATA/curated/SOURCE.report.json says what was removed and why), one
# tokenizer trained on both, then each source preprocessed into its own .bin/.idx pair
# (configs/tiny.py blends them). Quality filtering is off for both sources: MT-NLG applied it
# to Common Crawl only, and Gopher's repetition rules would drop a sixth of the Bible's
# chapters (docs/data.md, Curation). Per-source flags: CURATE_<source>.
CURATE_kjv ?= --stages exact fuzzy
CURATE_python_stdlib ?= --stages exact fuzzy
data: $(SOURCES:%=$(DATA)/%.idx)

$(DATA)/raw/.exported: $(VENV)/.installed launch/export_corpus.py mtnlg_jax/data/corpus.py
	$(PY) launch/export_corpus.py --out $(DATA)/raw
	touch $@

$(DATA)/curated/%.jsonl: $(DATA)/raw/.exported launch/curate.py $(wildcard mtnlg_jax/data/curate/*.py) \
		mtnlg_jax/data/ray_engine.py mtnlg_jax/data/pieces.py
	$(PY) launch/curate.py --input $(DATA)/raw/$*.jsonl --output $@ --workers 2 $(CURATE_$*)

$(DATA)/tokenizer.model: $(SOURCES:%=$(DATA)/curated/%.jsonl)
	$(PY) launch/preprocess.py --input $^ --train-tokenizer --vocab-size 8192 \
		--tokenizer-model $@

$(DATA)/%.idx: $(DATA)/tokenizer.model launch/preprocess.py
	$(PY) launch/preprocess.py --input $(DATA)/curated/$*.jsonl --tokenizer-model $< \
		--output-prefix $(DATA)/$* --append-eod --workers 2

# Training ends with the validation loss of the final checkpoint next to a unigram and a bigram
# model of the same tokens (bench/baselines.py), and a short sample, sampled: greedy decoding
# loops on a model this small ("the LORD, and the LORD, ...").
train: data
	$(DEVICES) $(PY) launch/train.py --config $(CONFIG) --workdir $(WORKDIR)
	$(DEVICES) $(PY) launch/evaluate.py --workdir $(WORKDIR) --task perplexity \
		--data $(DATA)/kjv --split valid --max_tokens 16384 --output $(WORKDIR)/eval/kjv_valid.json
	$(PY) bench/baselines.py --data $(DATA)/kjv --split valid --max_tokens 16384 \
		--model_eval $(WORKDIR)/eval/kjv_valid.json
	$(DEVICES) $(PY) launch/generate.py --workdir $(WORKDIR) --prompt "In the beginning" \
		--max_new_tokens 40 --do_sample --temperature 0.8 --top_p 0.95 --seed 0

# The same training as 2 processes x 4 CPU devices through jax.distributed (gloo), as it would
# run on 2 hosts: process 0 prints here, process 1 logs to $(WORKDIR)-2proc/logs/process_1.log.
train-multiprocess: data
	$(PY) launch/spawn.py --processes 2 --devices_per_process 4 -- \
		launch/train.py --config $(CONFIG) --workdir $(WORKDIR)-2proc

test: dev
	# three workers on the CI machine's 2 cores: a sixth of the two-worker run's CPU time is
	# waits (subprocesses starting, heartbeats, Ray), and a third worker fills it
	# (docs/benchmarks.md, "The test suite's time")
	$(PY) -m pytest -q -n 3 --dist loadfile -m "not serial"
	# the straggler drills compare processes' speeds: beside two other test files on 2 cores
	# the machine's load, not the drill, decides which process is slow; they run alone
	$(PY) -m pytest -q -m serial

# ruff's settings are in pyproject.toml (the rules checked, the files not yet formatted).
lint: dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) bench/throughput.py
	$(PY) bench/pipeline.py
	$(PY) bench/generate.py
	$(PY) bench/checkpoint.py
	$(PY) bench/scale.py --results runs/scale

clean:
	rm -rf $(VENV) $(DATA) runs .gpu-compile
