"""One pre-norm transformer block: x + Attention(norm(x)), then x + MLP(norm(x)).

Tensor parallelism (Megatron) comes from the logical names alone: QKV and MLP-in are split by
columns (`heads`, `mlp`), attention-out and MLP-out by rows, so each block needs one
all-reduce after attention and one after the MLP, inserted by XLA. The residual stream (layer
norms, dropout, residual adds) names its sequence axis `residual_seq`: under sequence
parallelism the rule table splits it over tensor, and each all-reduce becomes a reduce-scatter
plus an all-gather before the next column-parallel matmul (see parallel/rules.py).
"""

from flax import nnx

from mtnlg_jax.model import flash_attention, fp8, fp8_sites, moe
from mtnlg_jax.model.attention import CONTEXT_AXES, KV_AXES, Q_AXES, Attention
from mtnlg_jax.model.layers import (
    ATTN_RESIDUAL,
    MLP_RESIDUAL,
    RESIDUAL,
    SITES_PER_BLOCK,
    dropout,
    mlp,
    norm,
)
from mtnlg_jax.model.pieces import join, split
from mtnlg_jax.parallel.rules import constrain

# Names of the values `model.remat = 'selective'` keeps: every matmul output. The attention
# core (scores, softmax, dropout) is recomputed in the backward pass, as in Megatron's
# selective recompute (arXiv 2205.05198): cheap FLOPs, large memory. With GQA 'qkv' is the
# query and the (smaller) key/value projections, before rope (the rotation is recomputed);
# SwiGLU's gate and up projections are 'mlp_gate' and 'mlp_up' (silu(gate) * up recomputed;
# config/checks.py reads 'mlp_in' in model.remat_recompute and remat_offload as both), GeLU's
# one 'mlp_in'.
# The flash kernel's own out and log-sum-exp are kept too, so its forward does not run again;
# of a mixture of experts, the router's choice (the backward never routes again) and the
# grouped matmuls' outputs (model/moe.py). Under model.fp8 the products' quantized inputs and
# scales (model/fp8.py): the backward does not take x's amax and quantize it again (the
# quantized weights are not kept: they would cost more memory than requantizing saves time;
# a row-parallel product keeps its scale alone and requantizes its recomputed x: fp8_sites).
SELECTIVE_SAVED = (
    'qkv', 'context', 'attn_out', 'mlp_in', 'mlp_gate', 'mlp_up', 'mlp_out',
    *flash_attention.SAVED_NAMES, *moe.SAVED_NAMES, fp8.SAVED_NAMES[0],
)  # fmt: skip


def gathered(x):
    """A normalised input whole along the sequence: under sequence parallelism one all-gather
    across the tensor-parallel ranks that every projection reads (q and key/value, gate and
    up), not one each."""
    return constrain(x, ('batch', 'seq', 'embed'))


class Block(nnx.Module):
    """x + Attention(norm(x)), then x + MLP(norm(x)): `model.norm` (LayerNorm or RMSNorm) and
    `model.mlp` (GeLU or SwiGLU) pick the pieces (model/layers.py). GPT-3's block is
    LayerNorm + GeLU with learned positions; Llama's RMSNorm + SwiGLU with rope and GQA.
    With model.moe.experts > 0 a mixture of experts of that MLP kind (model/moe.py, the
    attribute `moe`) takes the MLP's place, but in a dense block (`dense`: the layers ahead of
    the experts, model.moe.dense_layers); grouped_matmul: moe.grouped_matmul_kind's."""

    def __init__(
        self,
        cfg,
        rngs,
        attention_kernel='plain',
        gpu_generation=None,
        grouped_matmul='blocks',
        dense=False,
    ):
        self.ln_attn = norm(cfg)
        self.attention = Attention(cfg, rngs, attention_kernel, gpu_generation)
        self.ln_mlp = norm(cfg)
        if moe.experts_of(cfg) and not dense:
            self.moe = moe.MoE(cfg, rngs, grouped_matmul)
        else:
            self.mlp = mlp(cfg, rngs)
        self.hidden_dropout = cfg.hidden_dropout
        self.pieces = cfg.get('sequence_pieces', 1)
        self.fp8_history = fp8_sites.history_buffer(cfg)  # delayed FP8 only, else None
        self.num_layers = cfg.num_layers

    def history(self):
        """The delayed FP8 recipe's amax history (sites, 2, length), or None."""
        return None if self.fp8_history is None else self.fp8_history[...]

    def __call__(self, x, row_keys, layer, positions=None, segment_ids=None, order=None):
        """(x, side values) of x: (batch, seq, embed); layer: this block's global index, for
        distinct dropout masks (and an MoE's row of its loads); positions: the tokens'
        positions for rope, None for 0 .. seq - 1; segment_ids: (batch, seq) packed
        documents' ids, or None; order: (batch, seq) the tokens' global positions under
        context parallelism (parallel/context.py), or None. Side values: an MoE block's
        (model/moe.py) and the delayed FP8 recipe's amax values (model/fp8_sites.py), {} for
        a dense block."""
        with fp8_sites.recording(self.history()) as amax:
            x, values = self.layers(x, row_keys, layer, positions, segment_ids, order)
        if amax is not None:
            values = {**values, **amax.values(layer, self.num_layers)}
        return x, values

    def layers(self, x, row_keys, layer, positions=None, segment_ids=None, order=None):
        """__call__'s attention and MLP halves, its side values but FP8's."""
        site, more = layer * SITES_PER_BLOCK, (positions, segment_ids, order)
        if fp8_sites.gathers_quantized(self.attention.fp8):  # its products gather x quantized
            with fp8_sites.gathering(gathered):
                return self.layers_on(x, lambda h: h, row_keys, site, layer, *more)
        return self.layers_on(x, gathered, row_keys, site, layer, *more)

    def layers_on(self, x, whole, row_keys, site, layer, positions, segment_ids, order):
        """layers' body, `whole` making a normalised input whole along the sequence for the
        projections that read it (gathered, or as it lies where FP8 gathers it quantized)."""
        attention, n = self.attention, self.pieces
        pieces = split(x, n, RESIDUAL)
        qkv = [attention.projections(whole(self.ln_attn(p))) for p in pieces]
        q, k, v = (join(parts, axes) for parts, axes in zip(zip(*qkv), (Q_AXES, KV_AXES, KV_AXES)))
        context = attention.context(
            *attention.rotated(q, k, v, positions), row_keys, site, segment_ids, order
        )
        h = [attention.project_out(c) for c in split(context, n, CONTEXT_AXES)]
        pieces = self.added(pieces, h, row_keys, site + ATTN_RESIDUAL)
        values = {}
        if hasattr(self, 'moe'):  # whole sequences: capacity counts a sequence's choices
            h, values = self.moe(self.ln_mlp(join(pieces, RESIDUAL)), layer)  # it gathers
            pieces = self.added(pieces, split(h, n, RESIDUAL), row_keys, site + MLP_RESIDUAL)
        else:
            h = [self.mlp(whole(self.ln_mlp(p))) for p in pieces]
            pieces = self.added(pieces, h, row_keys, site + MLP_RESIDUAL)
        return constrain(join(pieces, RESIDUAL), ('batch', 'residual_seq', 'embed')), values

    def added(self, pieces, h, row_keys, site):
        """The residual stream's pieces + their sublayer's outputs h (after dropout), piece
        by piece: a piece's next norm and all-gather wait on its own reduce-scatter alone,
        so XLA:GPU can run them while another piece's is on the wire (joined, the sum had
        waited on every piece's). Dropout draws its mask on the whole sequence, as without
        pieces (the sum then waits on every piece)."""
        if self.hidden_dropout and row_keys is not None:
            n = len(pieces)
            h = split(dropout(join(h, RESIDUAL), self.hidden_dropout, row_keys, site), n, RESIDUAL)
        return [p + d for p, d in zip(pieces, h)]

    def cached(self, x, cache, index, order=None):
        """The block on new tokens at positions index, ... with a KV cache (no dropout: for
        inference); returns (x, updated cache). See Attention.cached."""
        with fp8_sites.recording(self.history()):
            return self.cached_layers(x, cache, index, order)

    def cached_layers(self, x, cache, index, order=None):
        h, cache = self.attention.cached(self.ln_attn(x), cache, index, order)
        x = x + h
        if hasattr(self, 'moe'):
            x = x + self.moe(self.ln_mlp(x), 0)[0]
        else:
            x = x + self.mlp(self.ln_mlp(x))
        return constrain(x, ('batch', 'seq', 'embed')), cache
