"""The decoder in Flax NNX, every dimension named by its logical axis (parallel/rules.py).

layers.py            parameters with logical axes, the norms (LayerNorm, RMSNorm), the MLPs
                     (GeLU, SwiGLU), dropout
rope.py              rotary positions, Llama 3.1's frequency scaling
attention.py         causal self-attention (multi-head, grouped-query, rope, packed documents,
                     context parallelism's chunks, the KV cache)
attention_kernel.py  which attention kernel runs: cuDNN, the Pallas flash kernel, XLA's, plain
block.py             the pre-norm block: attention, then the MLP or the experts; what selective
                     recompute keeps
pieces.py            the block on pieces of the sequence (model.sequence_pieces)
flash_attention.py   the Pallas flash attention kernel (dropout, GQA, segment ids): its API
flash_kernels.py     the flash kernel's Pallas bodies: forward, dK/dV, dQ
grouped_matmul.py    a Pallas grouped matmul: each expert's rows times its own weights (MoE)
fp8.py               matmuls in FP8: tensorwise, delayed and blockwise scaling
fp8_sites.py         the block's matmuls in FP8 (model.fp8): which, and delayed's amax history
fp8_experts.py       the routed experts' matmuls in FP8, their scales over an exchange
gpt.py               the decoder (GPT-3 and Llama blocks): blocks stacked by layer, its pieces
                     for the engines
loss.py              the vocabulary-parallel output layer and cross-entropy, fused
decode.py            the forward with a KV cache
counts.py            parameter and model-FLOP counts
buffers.py           state outside the gradient: buffers a module declares, their update rules
moe.py               the mixture of experts in the MLP's place: fp32 router, tokens sorted by
                     expert through grouped matmuls, capacity, shared experts, its side values
moe_exchange.py      expert parallelism's token exchange: padded all_to_all or the chosen rows
                     by ragged_all_to_all, and parallel folding's region over tensor
"""
