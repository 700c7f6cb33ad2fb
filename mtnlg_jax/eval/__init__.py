"""Evaluation and generation: perplexity, LAMBADA, multiple choice, sampling with a KV cache."""
