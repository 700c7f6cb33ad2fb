"""Evaluation and generation; never imports the trainer or the planner.

workdir.py      a workdir's parameters on any mesh
scoring.py      log-likelihoods of continuations
tasks.py        perplexity, LAMBADA, multiple choice
generation.py   sampling with a KV cache
completion.py   Hugging Face-style settings, stop strings
harness.py      lm-evaluation-harness's model class (imported only by its users)
baselines.py    unigram and bigram models: the floor a trained model must clear
"""
