"""The decoder in Flax NNX, every dimension named by its logical axis (parallel/rules.py).

layers.py            embeddings, norms, dense layers with logical axes
block.py             attention, MLP, the pre-norm block; which attention kernel runs
flash_attention.py   the Pallas flash attention kernel with dropout
gpt.py               the decoder: blocks stacked by layer, its pieces for the engines
loss.py              the vocabulary-parallel output layer and cross-entropy, fused
decode.py            the forward with a KV cache
counts.py            parameter and model-FLOP counts
"""
