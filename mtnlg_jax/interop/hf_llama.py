"""Hugging Face LlamaForCausalLM <-> our Llama parameters, tensor by tensor; and the tensors
of the Llama's variants, whose config.json interop/hf_variants.py reads: Qwen3 (the Llama's
tensors plus q_norm / k_norm), Mixtral and Qwen3-MoE (experts in place of the MLP).

config.json comes in two layouts, both read: transformers 5's (`rope_parameters`: rope_theta,
rope_type, factor, ...) and the published Llama 3.1 checkpoints' (`rope_theta` beside
`rope_scaling`); export writes the second, which transformers 4.43+ and 5 both load. The
model keys it sets (`model_keys`) are the architecture; `config.model` keys it does not set
(compute dtype, recompute, the attention kernel, seq_len up to max_position_embeddings) stay
the user's.

Tensors (per layer i, `model.layers.{i}.`; E hidden, H heads, K kv_heads, D head_dim, F
intermediate, V vocab; HF's Linear weights are (out, in), ours (in, out), heads split out):

    HF name                            HF shape       ours (stacked on a leading `layers` axis)
    model.embed_tokens.weight          (V, E)         token_embed (padded V, E): zero rows added
    lm_head.weight                     (V, E)         output_embed (untied; absent when tied)
    model.norm.weight                  (E,)           final_norm.scale
    input_layernorm.weight             (E,)           blocks.ln_attn.scale
    post_attention_layernorm.weight    (E,)           blocks.ln_mlp.scale
    self_attn.q_proj.weight            (H D, E)       attention.q_kernel (E, H, D)         K < H
    self_attn.k_proj / v_proj.weight   (K D, E)       attention.kv_kernel (E, 2, K, D)     K < H
    self_attn.{q,k,v}_proj.weight      (H D, E)       attention.qkv_kernel (E, 3, H, D)    K = H
    self_attn.o_proj.weight            (E, H D)       attention.out_kernel (H, D, E)
    mlp.gate_proj / up_proj.weight     (F, E)         mlp.gate_kernel / in_kernel (E, F)
    mlp.down_proj.weight               (E, F)         mlp.out_kernel (F, E)
    (attention_bias, mlp_bias: the .bias of each projection, as q_bias, kv_bias, ...)
    self_attn.q_norm / k_norm.weight   (D,)           attention.qk_norm (2, D)   Qwen3, -MoE

Experts (X experts of width M, j = 0 .. X - 1; `architecture` picks the names):

    Mixtral: block_sparse_moe.   Qwen3-MoE: mlp.
    ...gate.weight                               (X, E)   moe.router_kernel (E, X)
    ...experts.{j}.w1 | gate_proj .weight        (M, E)   moe.gate_kernel (X, E, M)
    ...experts.{j}.w3 | up_proj .weight          (M, E)   moe.in_kernel (X, E, M)
    ...experts.{j}.w2 | down_proj .weight        (E, M)   moe.out_kernel (X, M, E)

Rope needs no permutation of q/k rows: our rope (model/rope.py) pairs channel i with
i + D / 2, as Hugging Face's rotate_half does. Each leaf is described by its axes and the
HF tensors it is made of (`LEAVES`), so a device's shard of a leaf is read as exactly the
rows and columns it holds (`read_leaf`: a device holding experts 2 and 3 reads those two
experts' tensors), and written back one layer at a time (`hf_tensors`).
"""

import dataclasses
import math

import numpy as np

from mtnlg_jax.interop.safetensors_files import SafetensorsError


class HFFormatError(ValueError):
    """A model directory that is not a Llama (or a variant) this model can express; the
    message says why."""


# Architectures and rope types read; others (Mistral's sliding window, Qwen2's q/k/v-only
# biases, yarn or linear rope scaling) are refused rather than converted approximately.
ARCHITECTURES = ('LlamaForCausalLM',)
ROPE_TYPES = {'default': 'none', None: 'none', 'llama3': 'llama3'}


def is_llama(hf_config):
    return hf_config.get('model_type') == 'llama' or any(
        a in ARCHITECTURES for a in hf_config.get('architectures') or ()
    )


def _rope(hf_config):
    """(rope_theta, our rope_scaling dict) from either config.json layout."""
    params = hf_config.get('rope_parameters')
    if params is None:  # Llama 3.1's published layout
        params = dict(hf_config.get('rope_scaling') or {})
        params['rope_theta'] = hf_config.get('rope_theta', 10000.0)
    rope_type = params.get('rope_type', params.get('type'))
    if rope_type not in ROPE_TYPES:
        raise HFFormatError(f'rope type {rope_type!r}: only {sorted(map(str, ROPE_TYPES))}')
    scaling = dict(type=ROPE_TYPES[rope_type])
    if scaling['type'] == 'llama3':
        for ours, theirs in (
            ('factor', 'factor'),
            ('low_freq_factor', 'low_freq_factor'),
            ('high_freq_factor', 'high_freq_factor'),
            ('original_context', 'original_max_position_embeddings'),
        ):
            if theirs not in params:
                raise HFFormatError(f'llama3 rope scaling without {theirs}')
            scaling[ours] = params[theirs]
        scaling['original_context'] = int(scaling['original_context'])
    return float(params['rope_theta']), scaling


def model_keys(hf_config):
    """The `config.model` keys a Llama config.json fixes (a dict): the architecture."""
    if not is_llama(hf_config):
        raise HFFormatError(f'not a Llama (model_type {hf_config.get("model_type")!r})')
    for key in ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'vocab_size',
                'intermediate_size'):  # fmt: skip
        if not isinstance(hf_config.get(key), int):
            raise HFFormatError(f'config.json has no integer {key}')
    if hf_config.get('hidden_act', 'silu') != 'silu':
        raise HFFormatError(f'hidden_act {hf_config["hidden_act"]!r}: only silu (SwiGLU)')
    bias = bool(hf_config.get('attention_bias', False))
    if bias != bool(hf_config.get('mlp_bias', False)):
        raise HFFormatError('attention_bias and mlp_bias differ; model.bias sets both')
    heads = hf_config['num_attention_heads']
    theta, scaling = _rope(hf_config)
    return dict(
        num_layers=hf_config['num_hidden_layers'],
        hidden=hf_config['hidden_size'],
        heads=heads,
        kv_heads=hf_config.get('num_key_value_heads') or heads,
        head_dim=hf_config.get('head_dim') or hf_config['hidden_size'] // heads,
        ffn_hidden=hf_config['intermediate_size'],
        vocab_size=hf_config['vocab_size'],
        layer_norm_epsilon=float(hf_config.get('rms_norm_eps', 1e-6)),
        position='rope',
        rope_theta=theta,
        rope_scaling=scaling,
        norm='rmsnorm',
        mlp='swiglu',
        tie_embeddings=bool(hf_config.get('tie_word_embeddings', False)),
        bias=bias,
        qk_norm=False,
        moe=dict(experts=0),
    )


def architecture(model_cfg):
    """The Hugging Face class of a Llama-block model: its q/k norms and experts decide."""
    experts = model_cfg.get('moe', {}).get('experts', 0)
    qk_norm = bool(model_cfg.get('qk_norm', False))
    return {
        (False, False): 'LlamaForCausalLM',
        (True, False): 'Qwen3ForCausalLM',
        (False, True): 'MixtralForCausalLM',
        (True, True): 'Qwen3MoeForCausalLM',
    }[qk_norm, bool(experts)]


def block_keys():
    """The `config.model` keys of Llama's block (what an export as LlamaForCausalLM needs)."""
    return dict(position='rope', norm='rmsnorm', mlp='swiglu')


def model_defaults(hf_config):
    """`config.model` keys a config.json suggests but the user may override."""
    return dict(
        init_std=float(hf_config.get('initializer_range', 0.02)),
        attention_dropout=float(hf_config.get('attention_dropout', 0.0)),
        hidden_dropout=0.0,
    )


def max_seq_len(hf_config):
    return hf_config.get('max_position_embeddings')


def hf_config_of(model_cfg, bos_id=None, eos_id=None, dtype='float32'):
    """A LlamaForCausalLM config.json (a dict, Llama 3.1's layout) of a resolved config.model."""
    scaling = model_cfg.rope_scaling
    rope_scaling = None
    if scaling.type == 'llama3':
        rope_scaling = dict(
            rope_type='llama3',
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_context,
        )
    heads, kv_heads, head_dim = dims(model_cfg)
    return dict(
        architectures=['LlamaForCausalLM'],
        model_type='llama',
        hidden_act='silu',
        hidden_size=model_cfg.hidden,
        intermediate_size=model_cfg.ffn_hidden,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max(model_cfg.seq_len, scaling.get('original_context', 0)),
        rms_norm_eps=model_cfg.layer_norm_epsilon,
        rope_theta=model_cfg.rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=model_cfg.bias,
        mlp_bias=model_cfg.bias,
        attention_dropout=model_cfg.attention_dropout,
        initializer_range=model_cfg.init_std,
        tie_word_embeddings=model_cfg.tie_embeddings,
        vocab_size=model_cfg.vocab_size,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        torch_dtype=dtype,
        use_cache=True,
    )


def dims(model_cfg):
    """(heads, kv_heads, head_dim) with model/layers.py's 0 = default rule."""
    heads = model_cfg.heads
    return heads, model_cfg.kv_heads or heads, model_cfg.head_dim or model_cfg.hidden // heads


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One of our parameters as HF tensors: `axes` names its axes (per layer for blocks) by
    letter; `sources` are the HF tensors stacked along axis `part` (None: one tensor), each
    (name, its axes as letter groups: 'hd' is one HF axis of H x D, h outer). Part 'x' (the
    experts) has one source, a name with {j}, one tensor per expert (`for_experts`)."""

    axes: str
    sources: tuple
    part: str = None

    def for_experts(self, experts):
        """This leaf with its per-expert source spelled out for each of `experts`."""
        if self.part != 'x':
            return self
        ((name, groups),) = self.sources
        names = (name.replace('{j}', str(j)) for j in range(experts))
        return dataclasses.replace(self, sources=tuple((n, groups) for n in names))


_L = 'model.layers.{i}.'
_ATT, _MLP = _L + 'self_attn.', _L + 'mlp.'


def _linear(names, out, kind='weight'):
    """The weight (out, in = e) or bias (out,) of HF Linear layers `names`."""
    groups = (out, 'e') if kind == 'weight' else (out,)
    return tuple((f'{name}.{kind}', groups) for name in names)


def _vector(name, axis='e'):
    return ((name, (axis,)),)


_Q = [_ATT + 'q_proj']
_KV = [_ATT + 'k_proj', _ATT + 'v_proj']
_GATE, _UP = [_MLP + 'gate_proj'], [_MLP + 'up_proj']
LEAVES = {
    ('token_embed',): Leaf('ve', (('model.embed_tokens.weight', ('v', 'e')),)),
    ('output_embed',): Leaf('ve', (('lm_head.weight', ('v', 'e')),)),
    ('final_norm', 'scale'): Leaf('e', _vector('model.norm.weight')),
    ('blocks', 'ln_attn', 'scale'): Leaf('e', _vector(_L + 'input_layernorm.weight')),
    ('blocks', 'ln_mlp', 'scale'): Leaf('e', _vector(_L + 'post_attention_layernorm.weight')),
    ('blocks', 'attention', 'q_kernel'): Leaf('ehd', _linear(_Q, 'hd')),
    ('blocks', 'attention', 'q_bias'): Leaf('hd', _linear(_Q, 'hd', 'bias')),
    ('blocks', 'attention', 'kv_kernel'): Leaf('etkd', _linear(_KV, 'kd'), 't'),
    ('blocks', 'attention', 'kv_bias'): Leaf('tkd', _linear(_KV, 'kd', 'bias'), 't'),
    ('blocks', 'attention', 'qkv_kernel'): Leaf('ethd', _linear(_Q + _KV, 'hd'), 't'),
    ('blocks', 'attention', 'qkv_bias'): Leaf('thd', _linear(_Q + _KV, 'hd', 'bias'), 't'),
    ('blocks', 'attention', 'out_kernel'): Leaf('hde', ((_ATT + 'o_proj.weight', ('e', 'hd')),)),
    ('blocks', 'attention', 'out_bias'): Leaf('e', _vector(_ATT + 'o_proj.bias')),
    ('blocks', 'mlp', 'gate_kernel'): Leaf('ef', _linear(_GATE, 'f')),
    ('blocks', 'mlp', 'gate_bias'): Leaf('f', _linear(_GATE, 'f', 'bias')),
    ('blocks', 'mlp', 'in_kernel'): Leaf('ef', _linear(_UP, 'f')),
    ('blocks', 'mlp', 'in_bias'): Leaf('f', _linear(_UP, 'f', 'bias')),
    ('blocks', 'mlp', 'out_kernel'): Leaf('fe', ((_MLP + 'down_proj.weight', ('e', 'f')),)),
    ('blocks', 'mlp', 'out_bias'): Leaf('e', _vector(_MLP + 'down_proj.bias')),
}
QK_NORM = {
    ('blocks', 'attention', 'qk_norm'): Leaf(
        'td', _vector(_ATT + 'q_norm.weight', 'd') + _vector(_ATT + 'k_norm.weight', 'd'), 't'
    ),
}


def _experts(prefix, gate, up, down):
    """The MoE leaves of experts named `prefix`experts.{j}.`gate` / `up` / `down`."""
    expert = prefix + 'experts.{j}.'
    down = ((expert + down + '.weight', ('e', 'm')),)
    return {
        ('blocks', 'moe', 'router_kernel'): Leaf('ex', ((prefix + 'gate.weight', ('x', 'e')),)),
        ('blocks', 'moe', 'gate_kernel'): Leaf('xem', _linear([expert + gate], 'm'), 'x'),
        ('blocks', 'moe', 'in_kernel'): Leaf('xem', _linear([expert + up], 'm'), 'x'),
        ('blocks', 'moe', 'out_kernel'): Leaf('xme', down, 'x'),
    }


EXPERTS = {
    'MixtralForCausalLM': _experts(_L + 'block_sparse_moe.', 'w1', 'w3', 'w2'),
    'Qwen3MoeForCausalLM': _experts(_MLP, 'gate_proj', 'up_proj', 'down_proj'),
}


def leaves(model_cfg):
    """{our parameter path: Leaf} of the model's Hugging Face class (`architecture`)."""
    name = architecture(model_cfg)
    return {**LEAVES, **(QK_NORM if name.startswith('Qwen3') else {}), **EXPERTS.get(name, {})}


def sizes(model_cfg):
    """Each axis letter's size in HF's tensors (v: the unpadded vocabulary; x the experts, m
    their width)."""
    heads, kv_heads, head_dim = dims(model_cfg)
    size = dict(
        e=model_cfg.hidden, h=heads, k=kv_heads, d=head_dim, f=model_cfg.ffn_hidden,
        v=model_cfg.vocab_size,
    )  # fmt: skip
    moe = model_cfg.get('moe', {})
    if moe.get('experts', 0):
        size.update(x=moe.experts, m=moe.ffn_hidden or model_cfg.ffn_hidden)
    return size


STACKS = ('dense_blocks', 'blocks')  # our leaves stacked over layers, in HF's layer order


def hf_layers(path, model_cfg):
    """The Hugging Face layer of each entry of our stacked leaf `path`: the dense layers
    ahead of the experts (model.moe.dense_layers = k, our `dense_blocks` stack) are HF's
    layers 0 .. k - 1, `blocks` the rest; [None] for a leaf outside the layers."""
    dense = model_cfg.get('moe', {}).get('dense_layers', 0)
    if path[0] == 'dense_blocks':
        return range(dense)
    return range(dense, model_cfg.num_layers) if path[0] == 'blocks' else [None]


def leaf_of(path, model_cfg):
    """The Leaf of our parameter `path` (a tuple of keys), its experts spelled out;
    HFFormatError if the model's Hugging Face class has none. A dense layer's leaves
    (`dense_blocks`) are the Llama block's."""
    table = leaves(model_cfg)
    key = ('blocks', *path[1:]) if path[0] == 'dense_blocks' else path
    if key not in table:
        raise HFFormatError(
            f'our parameter {".".join(path)} has no {architecture(model_cfg)} counterpart'
        )
    return table[key].for_experts(sizes(model_cfg).get('x', 0))


def hf_names(path, leaf, model_cfg):
    return [name.format(i=i) for i in hf_layers(path, model_cfg) for name, _ in leaf.sources]


def check_shapes(reader, path, leaf, model_cfg):
    """HFFormatError naming the first HF tensor of `path` missing or of another shape."""
    size = sizes(model_cfg)
    for name, groups in leaf.sources:
        expected = tuple(math.prod(size[a] for a in group) for group in groups)
        for i in hf_layers(path, model_cfg):
            full = name.format(i=i)
            if full not in reader:
                raise HFFormatError(f'no tensor {full} in its safetensors')
            try:
                shape = reader.shape(full)
            except SafetensorsError as e:
                raise HFFormatError(str(e)) from None
            if shape != expected:
                raise HFFormatError(f'{full} is {shape}, config.json says {expected}')


# Non-parameters some checkpoints carry: rope's inverse frequencies (older transformers).
_BUFFERS = ('rotary_emb.inv_freq',)


def params_on_mesh(reader, abstract, shardings, model_cfg):
    """Our fp32 parameters (a tree like `abstract`, ShapeDtypeStructs) laid out by `shardings`,
    each leaf made by jax.make_array_from_callback: every device reads its own shard of it
    from the files (read_leaf), so no host holds more than its devices' shards and one
    tensor's slice. HFFormatError, before anything is read, for a missing or misshapen
    tensor, or one the model has no place for (a Qwen3 q_norm would be dropped silently)."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    paths = [tuple(k.key for k in path) for path, _ in leaves]
    used = set()
    for path in paths:
        leaf = leaf_of(path, model_cfg)
        check_shapes(reader, path, leaf, model_cfg)
        used.update(hf_names(path, leaf, model_cfg))
    if model_cfg.tie_embeddings:
        used.add('lm_head.weight')  # a tied model's head, when stored, is the embedding again
    extra = [n for n in reader.names() if n not in used and not n.endswith(_BUFFERS)]
    if extra:
        raise HFFormatError(
            f'{len(extra)} tensor(s) have no place in this {architecture(model_cfg)} '
            f"(config.json's shape and options), e.g. {extra[0]}"
        )

    def make(path, value, sharding):
        keys = tuple(k.key for k in path)

        def read(index):
            return read_leaf(reader, keys, model_cfg, model_cfg.padded_vocab, index)

        return jax.make_array_from_callback(value.shape, sharding, read)

    return jax.tree_util.tree_map_with_path(make, abstract, shardings)


def read_leaf(reader, path, model_cfg, padded_vocab, index):
    """Our fp32 parameter `path`, or its slice `index` (a tuple of slices over our axes, the
    `layers` axis first for blocks), read from the HF tensors: only the rows and columns the
    slice needs are read where the layout allows (a head range is a row range), so a device
    reads about its own shard."""
    leaf = leaf_of(path, model_cfg)
    size = dict(sizes(model_cfg), t=len(leaf.sources))
    ours = dict(size, v=padded_vocab)
    layered = path[0] in STACKS
    hf_layer = hf_layers(path, model_cfg)
    shape = ((len(hf_layer),) if layered else ()) + tuple(ours[a] for a in leaf.axes)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = [range(n)[s] for n, s in zip(shape, index)]
    want = dict(zip(leaf.axes, bounds[1:] if layered else bounds))
    layers = [hf_layer[i] for i in bounds[0]] if layered else [None]
    per_layer = [_read_layer(reader, leaf, size, want, i) for i in layers]
    return np.stack(per_layer) if layered else per_layer[0]


def _read_layer(reader, leaf, size, want, layer):
    parts = want[leaf.part] if leaf.part else [0]
    read = [_read_source(reader, *leaf.sources[p], leaf, size, want, layer) for p in parts]
    if not leaf.part:
        return read[0]
    return np.stack(read, axis=leaf.axes.index(leaf.part))


def _read_source(reader, name, groups, leaf, size, want, layer):
    """One HF tensor's part of our slice `want` ({axis: range}), in our axis order."""
    hf_index, post, read_shape = [], {}, []
    for group in groups:
        outer, inner = group[0], group[1:]
        inner_size = math.prod(size[a] for a in inner)
        full_inner = all(len(want[a]) == size[a] for a in inner)
        outer_range = range(min(want[outer].start, size[outer]), min(want[outer].stop, size[outer]))
        if full_inner:  # a range of whole heads is a range of rows
            hf_index.append(slice(outer_range.start * inner_size, outer_range.stop * inner_size))
            post[outer] = range(len(outer_range))
            post.update({a: range(size[a]) for a in inner})
            read_shape += [len(outer_range)] + [size[a] for a in inner]
        else:  # a partial inner axis (a head_dim slice): read the whole axis, slice after
            hf_index.append(slice(None))
            post[outer] = outer_range
            post.update({a: want[a] for a in inner})
            read_shape += [size[a] for a in group]
    value = reader.read(name.format(i=layer), tuple(hf_index)).astype(np.float32)
    letters = ''.join(groups)
    value = value.reshape(read_shape)
    value = value[np.ix_(*[np.asarray(post[a], dtype=np.int64) for a in letters])]
    value = value.transpose([letters.index(a) for a in leaf.axes if a != leaf.part])
    if 'v' in letters and len(want['v']) > value.shape[leaf.axes.index('v')]:
        pad = [(0, 0)] * value.ndim  # the padded vocabulary's extra rows are zero
        pad[leaf.axes.index('v')] = (0, len(want['v']) - value.shape[leaf.axes.index('v')])
        value = np.pad(value, pad)
    return value


def hf_tensors(paths, get, model_cfg, dtype=np.float32):
    """(HF name, array) pairs of our parameters, in HF's order (embedding, layer by layer,
    norm, head), one layer of one leaf in memory at a time: get(path, layer) returns entry
    `layer` of our stacked leaf (None: the whole top-level leaf) as numpy."""
    size = sizes(model_cfg)
    top = [p for p in paths if p[0] not in STACKS]

    def convert(path, layer, hf_layer=None):
        leaf = leaf_of(path, model_cfg)
        value = np.asarray(get(path, layer), np.float32)
        if 'v' in leaf.axes:  # the padded vocabulary's rows are cut
            value = np.take(value, range(size['v']), axis=leaf.axes.index('v'))
        for p, (name, groups) in enumerate(leaf.sources):
            part = value
            if leaf.part:
                part = np.take(value, p, axis=leaf.axes.index(leaf.part))
            axes = leaf.axes.replace(leaf.part or '', '')
            letters = ''.join(groups)
            part = part.transpose([axes.index(a) for a in letters])
            shape = [math.prod(size[a] for a in group) for group in groups]
            yield name.format(i=hf_layer), np.ascontiguousarray(part.reshape(shape), dtype)

    for path in top:
        if path == ('token_embed',):
            yield from convert(path, None)
    for stack in STACKS:  # HF's layers in order: the dense ones first
        stacked = [p for p in paths if p[0] == stack]
        for i, hf_layer in enumerate(hf_layers((stack,), model_cfg) if stacked else ()):
            for path in stacked:
                yield from convert(path, i, hf_layer)
    for path in top:
        if path != ('token_embed',):
            yield from convert(path, None)
