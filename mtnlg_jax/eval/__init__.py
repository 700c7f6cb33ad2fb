"""Evaluation and generation: perplexity, LAMBADA, multiple choice, sampling with a KV cache,
and lm-evaluation-harness's model class (harness.py, imported only by its users)."""
