"""Data: Megatron indexed datasets, GPT samples, weighted blends and the trainer's loader.

launch/preprocess.py   raw text -> tokenizer.py or gpt2_bpe.py -> indexed.py (.bin/.idx)
loader.py              indexed.py -> gpt_dataset.py (splits, samples) -> blend.py -> mesh
corpus.py              the default corpus (King James Bible, Python standard library)
"""
