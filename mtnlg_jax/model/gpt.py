"""The decoder of Megatron-LM and MT-NLG (GPT-3's block) and of Llama, readable top to bottom.

    tokens (batch, seq)
      -> token embedding (vocab-parallel) [+ learned position embedding], dropout
      -> num_layers pre-norm blocks, stacked on a leading `layers` axis and scanned
         (compile time does not grow with depth; `remat` picks what the backward recomputes)
      -> final norm
      -> logits = hidden @ token_embedding.T   (tied output layer, still vocab-parallel; with
         model.tie_embeddings = False a separate output_embed of the same shape)

The block options (model/block.py, model/layers.py, model/rope.py) come from config keys; the
defaults are GPT-3's block, and Llama's is

    model.position = 'rope' (rope_theta, rope_scaling), norm = 'rmsnorm', mlp = 'swiglu',
    kv_heads < heads (GQA), tie_embeddings = False, bias = False

Parameter names (the tree `split` returns; L = layers, E = hidden, V = padded vocab, H =
heads, K = kv_heads, D = head_dim, F = ffn_hidden; [..] only under the option named):

    token_embed                     (V, E)
    [position_embed]                (seq_len, E)         position = 'learned'
    [output_embed]                  (V, E)               tie_embeddings = False
    final_norm.scale [.bias]        (E,)                 bias: layernorm only
    blocks.ln_attn / ln_mlp .scale [.bias]   (L, E)
    blocks.attention.qkv_kernel     (L, E, 3, H, D)      K = H  [qkv_bias (L, 3, H, D)]
    blocks.attention.q_kernel       (L, E, H, D)         K < H  [q_bias (L, H, D)]
    blocks.attention.kv_kernel      (L, E, 2, K, D)      K < H  [kv_bias (L, 2, K, D)]
    blocks.attention.out_kernel     (L, H, D, E)                [out_bias (L, E)]
    blocks.mlp.gate_kernel          (L, E, F)            mlp = 'swiglu' [gate_bias (L, F)]
    blocks.mlp.in_kernel            (L, E, F)                   [in_bias (L, F)]
    blocks.mlp.out_kernel           (L, F, E)                   [out_bias (L, E)]
    [blocks.attention.qk_norm]      (L, 2, D)            model.qk_norm (queries, keys)
    [blocks.moe.*]                  model/moe.py's       model.moe.experts > 0, in place
                                                         of blocks.mlp
    [dense_blocks.*]                (k, ...) as blocks'  model.moe.dense_layers = k: layers
                                    with the dense MLP   0 .. k - 1, ahead of the experts;
                                                         blocks then holds L - k layers

Biases of the projections exist only with model.bias (default True). Hugging Face Llama:
embed_tokens = token_embed, lm_head = output_embed, q_proj = q_kernel (E, H, D) transposed,
k_proj / v_proj = kv_kernel[:, 0] / [:, 1], o_proj = out_kernel, gate_proj / up_proj /
down_proj = gate_kernel / in_kernel / out_kernel, input_layernorm = ln_attn,
post_attention_layernorm = ln_mlp, norm = final_norm; rope pairs channel i with i + D / 2 as
Hugging Face does (no row permutation).

Parameters live in fp32; `cast_params` makes the compute-dtype copy the forward runs on (each
module also casts a parameter to `model.compute_dtype` where it uses it, so fp32 parameters
give the same forward).
The cross-entropy works on the vocabulary shards (logsumexp and the label's logit are
reductions over `vocab`), so no device ever holds the full (batch, seq, vocab) logits.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from mtnlg_jax.config import block_stack_layers, offloaded, recomputed
from mtnlg_jax.model.attention_kernel import attention_kernel, gpu_generation
from mtnlg_jax.model.block import SELECTIVE_SAVED, Block
from mtnlg_jax.model import fp8_sites, moe
from mtnlg_jax.model.buffers import Buffer
from mtnlg_jax.model.layers import SITES_PER_BLOCK, dropout, norm, param, use
from mtnlg_jax.model import loss
from mtnlg_jax.model.loss import cross_entropy  # also the callers' name: gpt.cross_entropy
from mtnlg_jax.parallel.rules import constrain
from mtnlg_jax.parallel import stage_functions as side
from mtnlg_jax.parallel import taps as taps_lib
from mtnlg_jax.parallel.stage_functions import StageFunctions

# cuDNN's fused attention forward (jax.nn.dot_product_attention, implementation 'cudnn'):
# its backward reads the forward's output and softmax statistics, residuals JAX makes inside
# its own custom_vjp where no name of ours reaches them; selective recompute keeps that
# primitive's outputs, so the backward does not run the forward kernel again (7.5 % of
# Qwen3-235B-A22B's model FLOPs when it did: docs/benchmarks.md).
CUDNN_ATTENTION_FORWARD = 'dot_product_attention_fwd_wrapper'


def _cudnn_attention_forward(primitive, *_, **__):
    return primitive.name == CUDNN_ATTENTION_FORWARD


def remat_policy(remat, recompute=(), offload=()):
    """`model.remat`'s jax.checkpoint policy (None for 'none'); under selective, the names
    in `recompute` (model.remat_recompute) are made again by the backward, not kept, and
    those in `offload` (model.remat_offload) are kept in the host's memory (JAX moves them
    there in the forward and back in the backward; the pipeline engine moves its own:
    parallel/offload.py)."""
    if remat == 'full':
        return jax.checkpoint_policies.nothing_saveable
    if remat != 'selective':
        return None
    kept = [name for name in SELECTIVE_SAVED if name not in recompute]
    if not any(name in offload for name in kept):
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.save_only_these_names(*kept), _cudnn_attention_forward
        )
    named = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[name for name in kept if name not in offload],
        names_which_can_be_offloaded=[name for name in kept if name in offload],
        offload_src='device',
        offload_dst='pinned_host',
    )

    def policy(primitive, *args, **params):  # save_from_both_policies takes bools only
        return _cudnn_attention_forward(primitive) or named(primitive, *args, **params)

    return policy


class GPT(nnx.Module):
    def __init__(self, cfg, rngs, device=None):
        """cfg: a resolved `config.model` (ffn_hidden and padded_vocab filled in); device: the
        mesh's first, which picks the attention kernel (attention_kernel.attention_kernel)."""
        self.token_embed = param(
            rngs, (cfg.padded_vocab, cfg.hidden), ('vocab', 'embed'), cfg.init_std
        )
        learned = cfg.get('position', 'learned') == 'learned'
        self.position_embed = (  # rope: None, the blocks rotate queries and keys
            param(rngs, (cfg.seq_len, cfg.hidden), ('position', 'embed'), cfg.init_std)
            if learned
            else None
        )
        layer_keys = jax.random.split(rngs.params(), cfg.num_layers)
        tied = cfg.get('tie_embeddings', True)
        self.output_embed = (
            None
            if tied
            else param(rngs, (cfg.padded_vocab, cfg.hidden), ('vocab', 'embed'), cfg.init_std)
        )
        kernel = attention_kernel(cfg, device)
        grouped = moe.grouped_matmul_kind(device)

        def stack(keys, axis, dense=False):
            make = nnx.vmap(
                lambda key: Block(
                    cfg, nnx.Rngs(params=key), kernel, gpu_generation(device), grouped, dense
                ),
                transform_metadata={nnx.PARTITION_NAME: axis, 'logical_axes': axis},
            )
            return make(keys)

        self.experts = moe.experts_of(cfg)  # 0: dense blocks
        # The first dense_layers layers (ahead of a mixture of experts) are a stack of their
        # own, run with the embedding; each layer keeps its key, so its index in the model.
        self.dense_layers = cfg.num_layers - block_stack_layers(cfg)
        k = self.dense_layers
        self.dense_blocks = stack(layer_keys[:k], 'dense_layers', dense=True) if k else None
        self.blocks = stack(layer_keys[k:] if k else layer_keys, 'layers')
        self.final_norm = norm(cfg)
        self.num_layers = cfg.num_layers
        self.vocab_size = cfg.vocab_size
        self.hidden_dropout = cfg.hidden_dropout
        self.remat = cfg.remat
        self.recompute = recomputed(cfg)
        self.offload = offloaded(cfg)
        self.loss_chunks = cfg.loss_chunks
        self.dtype = cfg.compute_dtype
        self.fp8 = cfg.get('fp8', 'none')
        self.fp8_setting = fp8_sites.settings(cfg)

    def __call__(self, tokens, row_keys=None, positions=None, segment_ids=None):
        """Final hidden states (batch, seq, embed). row_keys: one PRNG key per sequence, or
        None for no dropout; positions, segment_ids (batch, seq): packed documents'
        (data/packing.py), or None for 0 .. seq - 1 and one segment."""
        graphdef, stacked = nnx.split(self.blocks)
        x = self.lead_in(tokens, row_keys, positions, segment_ids)
        x, _ = apply_block_stack(
            graphdef,
            stacked,
            x,
            row_keys,
            self.remat,
            first_layer=self.dense_layers,
            positions=positions,
            segment_ids=segment_ids,
            declared=self.side_values(),
            recompute=self.recompute,
            offload=self.offload,
        )
        return self.final_norm(x)

    def lead_in(self, tokens, row_keys=None, positions=None, segment_ids=None, order=None):
        """What runs ahead of the block stack, where the embedding runs (a pipeline's first
        stage, its first chunk): the embedding, then the dense layers ahead of a mixture of
        experts, if any (layers 0 .. dense_layers - 1; a dense block emits no side value
        but FP8's delayed amax, which config/checks.py refuses with them)."""
        x = self.embed(tokens, row_keys, positions)
        if self.dense_blocks is None:
            return x
        graphdef, stacked = nnx.split(self.dense_blocks)
        x, _ = apply_block_stack(
            graphdef, stacked, x, row_keys, self.remat, 0, positions, segment_ids, order=order,
            recompute=self.recompute, offload=self.offload,
        )  # fmt: skip
        return x

    def side_values(self):
        """{name: SideValue} the block stack emits (parallel/stage_functions.py): an MoE's,
        the delayed FP8 recipe's (model/fp8_sites.py)."""
        fp8 = fp8_sites.side_values(self.fp8, self.num_layers)
        return {**moe.side_values(self.num_layers, self.experts), **fp8}

    def embed(self, tokens, row_keys=None, positions=None):
        """Token (+ learned position) embeddings (..., seq, embed) of tokens (..., seq), with
        dropout; positions (..., seq) or None for 0 .. seq - 1 (rope: applied in the blocks)."""
        x = jnp.take(self.token_embed[...], tokens, axis=0).astype(self.dtype)
        if self.position_embed is not None:
            table = use(self.position_embed, self.dtype)
            if positions is None:
                x = x + table[: tokens.shape[-1]]
            else:
                x = x + jnp.take(table, positions, axis=0)
        x = constrain(x, ('batch', 'residual_seq', 'embed'))
        return dropout(x, self.hidden_dropout, row_keys, site=self.num_layers * SITES_PER_BLOCK)

    def logits(self, hidden):
        """(..., batch, seq, vocab) fp32 logits, sharded over `vocab`; padding rows at -inf."""
        return loss.logits(hidden, self.output_table(), self.vocab_size)

    def output_table(self):
        """The output layer's (vocab, embed) rows in the compute dtype: the token embedding
        when tied (the default), else output_embed."""
        table = self.token_embed if self.output_embed is None else self.output_embed
        return use(table, self.dtype)

    def token_loss_sum(self, hidden, labels, loss_mask=None):
        """Summed cross-entropy of `labels` (batch, seq) under the logits of final hidden
        states (batch, seq, embed), each token's weighted by loss_mask (batch, seq) if given:
        the output layer and the loss fused (model/loss.py), in `loss_chunks` pieces of the
        sequence."""
        embed = self.output_table()
        return loss.head_loss_sum(
            hidden, embed, labels, self.vocab_size, self.loss_chunks, loss_mask
        )


def apply_block_stack(
    graphdef,
    stacked,
    x,
    row_keys,
    remat='none',
    first_layer=0,
    positions=None,
    segment_ids=None,
    used=None,
    declared=None,
    order=None,
    taps=None,
    unroll=False,
    weights=None,
    recompute=(),
    offload=(),
):
    """(x, side values): blocks whose parameters are stacked on a leading axis run over x
    with lax.scan, the values each emits combined over the blocks (declared: {name:
    SideValue}, None: none). graphdef: one Block's graph; first_layer: the global index of
    the first (for dropout); taps: None, or the zero taps of the blocks' kernel matmuls
    (parallel/taps.py: per site (x, y) or (y,), stacked over the blocks; [] while probing them);
    positions: the tokens' positions for rope (None: 0 .. seq - 1); segment_ids: (batch,
    seq) packed documents' ids, or None; used: how many of the stacked blocks are layers (a
    traced int; the rest are a short pipeline stage's padding slots, parallel/stage_order.py),
    or None for all; recompute, offload: model.remat_recompute's and model.remat_offload's
    names (remat_policy); order: (batch, seq) the tokens' global positions under context
    parallelism (parallel/context.py), None: 0 .. seq - 1; unroll: the scan unrolled (the
    pipeline's steady tick: its forward's and backward's layers in one computation); weights:
    the blocks' FP8 weights quantized once a step (fp8_sites.quantized_weights, a pipeline
    chunk's), None: the step's stack (fp8_sites.stack_weights) if any, else each layer
    quantizes its own.

    A padding slot runs its block (zero parameters) and drops the result: x passes through
    and the slot's parameters get zero gradients. Skipping it (lax.cond) would save no time,
    since a pipeline tick lasts as long as the deepest chunk any stage runs, and a conditional
    around each layer hides the layers' tensor collectives from XLA:GPU's scheduler (Llama 3
    405B: 29 % of them hidden in a cond, 81 % without; docs/training.md)."""
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    declared = declared or {}

    def one_block(carry, slot_layer_and_params):
        x, values = carry
        slot, layer, params, weights, *layer_taps = slot_layer_and_params
        ran = None if used is None else slot < used
        block = nnx.merge(graphdef, params)
        with fp8_sites.layer_weights(weights):
            if layer_taps:
                with taps_lib.tapping(_kernels(block), layer_taps[0]):
                    out, emitted = block(x, row_keys, layer, positions, segment_ids, order)
            else:
                out, emitted = block(x, row_keys, layer, positions, segment_ids, order)
        if ran is not None:
            out, emitted = jnp.where(ran, out, x), side.where_ran(declared, ran, emitted)
        return (out, side.combine(declared, values, emitted)), None

    if remat != 'none':
        policy = remat_policy(remat, recompute, offload)
        one_block = jax.checkpoint(one_block, policy=policy, prevent_cse=False)
    slots = jnp.arange(num_layers)
    init = (x, side.identities(declared))
    if weights is None:  # FP8 weights quantized once a step, or None
        weights = fp8_sites.stack_weights(num_layers)
    xs = (slots, first_layer + slots, stacked, weights) + (() if taps is None else (taps,))
    (x, values), _ = jax.lax.scan(one_block, init, xs, unroll=unroll)
    return x, values


def _kernels(block):
    """{id(parameter variable): its path} of a block's parameters (the taps' kernels)."""
    return {id(v): path for path, v in nnx.iter_graph(block) if isinstance(v, nnx.Param)}


def cast_params(params, dtype):
    """The compute copy of the fp32 master parameters."""
    return jax.tree.map(lambda p: p.astype(dtype), params)


def loss_sum(model, batch, row_keys=None, packed=None):
    """Summed next-token loss and token count of `batch` (batch, seq + 1). packed: the
    inputs' positions, segment ids and loss mask (data/packing.py's Packed, each may be
    None), or None; with a loss mask the sum and the count are of the tokens it weighs."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    positions, segment_ids, loss_mask = (None,) * 3 if packed is None else packed
    hidden = model(inputs, row_keys, positions, segment_ids)
    total = model.token_loss_sum(hidden, labels, loss_mask)
    count = labels.size if loss_mask is None else loss_mask.sum()
    return total, jnp.asarray(count, jnp.float32)


def create(cfg, seed, device=None):
    """A GPT with parameters initialised from `seed`, its attention kernel chosen for `device`
    (the mesh's first; None: the CPU's)."""
    return GPT(cfg, nnx.Rngs(params=seed), device)


def split(model):
    """(graphdef, fp32 parameters as a plain dict, their logical axis names); the model's
    buffers (model/buffers.py) are not among them: `buffers` has them."""
    graphdef, _, state = nnx.split(model, Buffer, ...)
    return graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(_metadata(state, 'logical_axes'))


def buffers(model):
    """(the model's buffers as a plain dict, their logical axis names, their update rules'
    names): empty dicts for a model without any."""
    _, state, _ = nnx.split(model, Buffer, ...)
    axes, rules = (nnx.to_pure_dict(_metadata(state, k)) for k in ('logical_axes', 'rule'))
    return nnx.to_pure_dict(state), axes, rules


def _metadata(state, key):
    return jax.tree.map(
        lambda v: v.get_metadata()[key], state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def merge(graphdef, params, buffers=None):
    """The module view of a plain parameter dict and, for a model that has them, its buffers
    (inside jit: free)."""
    return nnx.merge(graphdef, nnx.State(params), nnx.State(buffers or {}))


def stage_functions(graphdef, param_axes=None):
    """The GPT's pieces as the engines run them (parallel/stage_functions.py says what each
    takes), from its graphdef alone; param_axes: the parameters' logical axes (split's third).
    The settings and the blocks' graph come from a skeleton: the graph with a placeholder for
    every array. The embedding, final norm and head run on a view of the caller's shared
    parameters whose blocks are those placeholders, which they never read. A micro-batch's
    positions, segment ids and loss mask (packed documents) reach the embedding, the blocks
    and the loss. Under tensorwise or delayed FP8, prepare quantizes a chunk's block weights
    (fp8_sites.quantized_weights), which apply_blocks takes as `prepared`."""
    placeholder = jax.ShapeDtypeStruct((), jnp.float32)
    skeleton = nnx.merge(graphdef, [placeholder] * graphdef.num_leaves)
    block_graphdef, placeholder_blocks = nnx.split(skeleton.blocks)
    placeholder_blocks = nnx.to_pure_dict(placeholder_blocks)
    declared = skeleton.side_values()

    def view(shared):
        return merge(graphdef, {**shared, 'blocks': placeholder_blocks})

    def embed(shared, batch):
        model = view(shared)
        if model.dense_blocks is None:
            return model.embed(batch.tokens, batch.row_keys, batch.positions)
        fields = (batch.row_keys, batch.positions, batch.segment_ids, batch.order)
        return model.lead_in(batch.tokens, *fields)

    def apply_blocks(
        chunk, hidden, batch, first_layer, remat, used=None, taps=None, unroll=False,
        prepared=None, offload=True,
    ):  # fmt: skip
        keys, positions, segment_ids = batch.row_keys, batch.positions, batch.segment_ids
        if skeleton.dense_layers:  # the block stack's layers follow the dense ones
            first_layer = first_layer + skeleton.dense_layers
        return apply_block_stack(
            block_graphdef,
            chunk,
            hidden,
            keys,
            remat,
            first_layer,
            positions,
            segment_ids,
            used=used,
            declared=declared,
            order=batch.order,
            taps=taps,
            unroll=unroll,
            weights=prepared,
            recompute=skeleton.recompute,
            offload=skeleton.offload if offload else (),
        )

    def head_loss_sum(shared, hidden, batch):
        model = view(shared)
        return model.token_loss_sum(model.final_norm(hidden), batch.labels, batch.loss_mask)

    def logits_loss_sum(shared, hidden, batch):
        model = view(shared)
        losses = cross_entropy(model.logits(model.final_norm(hidden)), batch.labels)
        return (losses if batch.loss_mask is None else losses * batch.loss_mask).sum()

    def prepare(chunk):  # FP8's weights of a chunk, quantized once a step
        return fp8_sites.quantized_weights(skeleton.fp8_setting, chunk)

    once = skeleton.fp8 in ('tensorwise', 'delayed')
    return StageFunctions(
        embed=embed,
        apply_blocks=apply_blocks,
        head_loss_sum=head_loss_sum,
        logits_loss_sum=logits_loss_sum,
        remat=skeleton.remat,
        remat_policy=remat_policy(skeleton.remat, skeleton.recompute, skeleton.offload),
        offload=skeleton.offload,
        dtype=jnp.dtype(skeleton.dtype),
        param_axes=param_axes,
        values=declared,
        prepare=prepare if once else None,
    )
