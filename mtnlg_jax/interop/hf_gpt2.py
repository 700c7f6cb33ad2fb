"""Hugging Face GPT-2 checkpoints <-> this project's parameters, with safetensors and numpy.

A Hugging Face GPT-2 model directory holds config.json (n_embd, n_layer, n_head, n_positions,
vocab_size, layer_norm_epsilon, activation_function, ...) and model.safetensors (or shards
with their index, safetensors_files.py). Its blocks are Conv1D layers, whose weights are
stored (in, out), so they need no transpose here:

    HF name (h.{i}. ...)        HF shape        ours (stacked on a leading `layers` axis)
    wte.weight                  (V, E)          token_embed (padded_vocab, E): rows padded
    wpe.weight                  (P, E)          position_embed
    ln_1.weight / .bias         (E,)            blocks.ln_attn.scale / .bias
    attn.c_attn.weight / .bias  (E, 3E) / (3E,) blocks.attention.qkv_kernel (E, 3, H, D) /
                                                qkv_bias (3, H, D): [q | k | v], heads major
    attn.c_proj.weight / .bias  (E, E) / (E,)   blocks.attention.out_kernel (H, D, E) / out_bias
    ln_2.weight / .bias         (E,)            blocks.ln_mlp.scale / .bias
    mlp.c_fc.weight / .bias     (E, F) / (F,)   blocks.mlp.in_kernel / in_bias
    mlp.c_proj.weight / .bias   (F, E) / (E,)   blocks.mlp.out_kernel / out_bias
    ln_f.weight / .bias         (E,)            final_norm.scale / .bias

The output layer is tied to wte in both (lm_head.weight, when present, is wte again). Some
exports prefix every name with "transformer."; the causal-mask buffers (attn.bias,
attn.masked_bias) of old exports are not parameters. The vocabulary (50257 for GPT-2) is
padded with zero rows to the model's padded_vocab on import (the padded logits are -inf in
the model) and cut back on export, so export then import is bit-exact.
"""

import json
import os
import re

import numpy as np

from mtnlg_jax.interop import safetensors_files

# Activation names of Hugging Face configs that are GPT-2's tanh-approximated GeLU.
TANH_GELU = ('gelu_new', 'gelu_pytorch_tanh')
_NOT_PARAMETERS = re.compile(r'(h\.\d+\.attn\.(bias|masked_bias)|lm_head\.weight)$')
_PER_LAYER = {  # HF suffix -> (our path in blocks, their shape -> ours)
    'ln_1.weight': ('ln_attn', 'scale'),
    'ln_1.bias': ('ln_attn', 'bias'),
    'attn.c_attn.weight': ('attention', 'qkv_kernel'),
    'attn.c_attn.bias': ('attention', 'qkv_bias'),
    'attn.c_proj.weight': ('attention', 'out_kernel'),
    'attn.c_proj.bias': ('attention', 'out_bias'),
    'ln_2.weight': ('ln_mlp', 'scale'),
    'ln_2.bias': ('ln_mlp', 'bias'),
    'mlp.c_fc.weight': ('mlp', 'in_kernel'),
    'mlp.c_fc.bias': ('mlp', 'in_bias'),
    'mlp.c_proj.weight': ('mlp', 'out_kernel'),
    'mlp.c_proj.bias': ('mlp', 'out_bias'),
}


class HFFormatError(ValueError):
    """A model directory that is not a GPT-2 this model can express; the message says why."""


def block_keys():
    """The `config.model` keys of GPT-2's block (what any GPT-2 checkpoint fixes)."""
    return dict(
        position='learned', norm='layernorm', mlp='gelu', kv_heads=0, head_dim=0,
        tie_embeddings=True, bias=True,
    )  # fmt: skip


def model_keys(hf_config):
    """The `config.model` keys a Hugging Face GPT-2 config.json (a dict) fixes: the
    architecture."""
    activation = hf_config.get('activation_function', 'gelu_new')
    if activation not in TANH_GELU:
        raise HFFormatError(f'activation_function {activation!r}: only {TANH_GELU} (tanh GeLU)')
    for key, supported in (
        ('scale_attn_weights', True),
        ('scale_attn_by_inverse_layer_idx', False),
        ('add_cross_attention', False),
    ):
        if hf_config.get(key, supported) != supported:
            raise HFFormatError(f'{key}={hf_config[key]} is not supported')
    for key in ('n_embd', 'n_layer', 'n_head', 'n_positions', 'vocab_size'):
        if not isinstance(hf_config.get(key), int):
            raise HFFormatError(f'config.json has no integer {key}')
    hidden = hf_config['n_embd']
    return dict(
        block_keys(),
        num_layers=hf_config['n_layer'],
        hidden=hidden,
        heads=hf_config['n_head'],
        ffn_hidden=hf_config.get('n_inner') or 4 * hidden,
        seq_len=hf_config['n_positions'],
        vocab_size=hf_config['vocab_size'],
        layer_norm_epsilon=hf_config.get('layer_norm_epsilon', 1e-5),
    )


def model_defaults(hf_config):
    """`config.model` keys a GPT-2 config.json suggests but the user may override."""
    return dict(
        init_std=hf_config.get('initializer_range', 0.02),
        attention_dropout=hf_config.get('attn_pdrop', 0.1),
        hidden_dropout=hf_config.get('resid_pdrop', 0.1),
    )


def hf_config_of(model_cfg, eod_id=None):
    """A Hugging Face GPT2LMHeadModel config.json (a dict) of a resolved `config.model`;
    eod_id: the tokenizer's end-of-text id (default: the last, GPT-2's 50256)."""
    eod_id = model_cfg.vocab_size - 1 if eod_id is None else eod_id
    return dict(
        architectures=['GPT2LMHeadModel'],
        model_type='gpt2',
        activation_function='gelu_new',
        n_embd=model_cfg.hidden,
        n_layer=model_cfg.num_layers,
        n_head=model_cfg.heads,
        n_inner=model_cfg.ffn_hidden,
        n_positions=model_cfg.seq_len,
        n_ctx=model_cfg.seq_len,
        vocab_size=model_cfg.vocab_size,
        layer_norm_epsilon=model_cfg.layer_norm_epsilon,
        initializer_range=model_cfg.init_std,
        attn_pdrop=model_cfg.attention_dropout,
        resid_pdrop=model_cfg.hidden_dropout,
        embd_pdrop=model_cfg.hidden_dropout,
        scale_attn_weights=True,
        tie_word_embeddings=True,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
    )


def read(directory):
    """(config.json as a dict, {HF name without 'transformer.': numpy array})."""
    config_path = os.path.join(directory, 'config.json')
    if not os.path.isfile(config_path):
        raise HFFormatError(f'{config_path} not found')
    try:
        with open(config_path) as f:
            hf_config = json.load(f)
    except ValueError as e:
        raise HFFormatError(f'{config_path}: not JSON ({e})') from None
    if not isinstance(hf_config, dict):
        raise HFFormatError(f'{config_path}: not a JSON object')
    try:
        with safetensors_files.Reader(directory) as reader:
            stored = {name: reader.read(name) for name in reader.names()}
    except safetensors_files.SafetensorsError as e:
        raise HFFormatError(str(e)) from None
    tensors = {}
    for name, value in stored.items():
        name = name.removeprefix('transformer.')
        if not _NOT_PARAMETERS.match(name):
            tensors[name] = value
    return hf_config, tensors


def write(directory, hf_config, tensors):
    """config.json and the weights (safetensors_files.write: one file, or shards above 5 GB)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump(hf_config, f, indent=2)
    safetensors_files.write(directory, tensors.items())


def params_from_hf(tensors, model_cfg):
    """Our fp32 parameter dict (as gpt.split's) from HF tensors, for a resolved config.model."""
    layers, hidden, heads = model_cfg.num_layers, model_cfg.hidden, model_cfg.heads
    head_dim = hidden // heads
    ours_shape = {  # the attention's fused, head-split shapes; every other leaf keeps its own
        ('attention', 'qkv_kernel'): (hidden, 3, heads, head_dim),
        ('attention', 'qkv_bias'): (3, heads, head_dim),
        ('attention', 'out_kernel'): (heads, head_dim, hidden),
    }

    def take(name, shape=None):
        if name not in tensors:
            raise HFFormatError(f'model.safetensors has no tensor {name}')
        value = np.asarray(tensors[name], np.float32)
        return value if shape is None else value.reshape(shape)

    blocks = {}
    for suffix, (module, leaf) in _PER_LAYER.items():
        shape = ours_shape.get((module, leaf))
        stacked = np.stack([take(f'h.{i}.{suffix}', shape) for i in range(layers)])
        blocks.setdefault(module, {})[leaf] = stacked
    wte = take('wte.weight')
    if wte.shape != (model_cfg.vocab_size, hidden):
        raise HFFormatError(
            f'wte.weight is {wte.shape}, config says {(model_cfg.vocab_size, hidden)}'
        )
    token_embed = np.zeros((model_cfg.padded_vocab, hidden), np.float32)
    token_embed[: model_cfg.vocab_size] = wte
    return dict(
        blocks=blocks,
        final_norm=dict(scale=take('ln_f.weight'), bias=take('ln_f.bias')),
        position_embed=take('wpe.weight'),
        token_embed=token_embed,
    )


def hf_from_params(params, model_cfg):
    """HF tensors (float32 numpy, unpadded vocabulary) of our parameter dict."""
    hidden = model_cfg.hidden
    tensors = {
        'wte.weight': np.asarray(params['token_embed'])[: model_cfg.vocab_size],
        'wpe.weight': np.asarray(params['position_embed']),
        'ln_f.weight': np.asarray(params['final_norm']['scale']),
        'ln_f.bias': np.asarray(params['final_norm']['bias']),
    }
    hf_shape = {  # Conv1D's fused shapes of the attention's head-split parameters
        ('attention', 'qkv_kernel'): (hidden, 3 * hidden),
        ('attention', 'qkv_bias'): (3 * hidden,),
        ('attention', 'out_kernel'): (hidden, hidden),
    }
    for suffix, (module, leaf) in _PER_LAYER.items():
        stacked = np.asarray(params['blocks'][module][leaf])
        shape = hf_shape.get((module, leaf), stacked.shape[1:])
        for i in range(model_cfg.num_layers):
            tensors[f'h.{i}.{suffix}'] = stacked[i].reshape(shape)
    return {name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()}
