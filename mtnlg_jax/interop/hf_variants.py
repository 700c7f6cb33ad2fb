"""The Llama's Hugging Face variants' config.json <-> our model keys: Qwen3ForCausalLM (the
Llama block with model.qk_norm), MixtralForCausalLM and Qwen3MoeForCausalLM (model.moe's
experts in place of the MLP, Qwen3-MoE with q/k norms). Their tensors are the Llama's with a
few more (interop/hf_llama.py's LEAVES, QK_NORM, EXPERTS); what differs is read here, the
rest by hf_llama's own functions.

config.json comes in two layouts, both read: transformers 5's (`rope_parameters`; the experts
`num_local_experts` for Mixtral and Qwen3-MoE alike) and the published checkpoints'
(`rope_theta`; Qwen3-MoE's experts `num_experts`). Export writes the published one, which
transformers 4.51+ and 5 both load.

    HF key                       ours
    num_local_experts | num_experts     model.moe.experts
    num_experts_per_tok          model.moe.top_k
    intermediate_size            Mixtral: model.moe.ffn_hidden (and model.ffn_hidden);
                                 Qwen3-MoE: model.ffn_hidden (its dense layers' MLP)
    moe_intermediate_size        Qwen3-MoE: model.moe.ffn_hidden
    norm_topk_prob               model.moe.norm_top_k (Mixtral always renormalises)
    mlp_only_layers = [0 .. k-1] Qwen3-MoE: model.moe.dense_layers = k (HF's layers 0 .. k - 1
                                 are our dense_blocks stack, the rest our blocks)
    (softmax router, no shared experts, dropless: fixed)

What we cannot represent is refused, one HFFormatError naming the key: sliding-window
attention (Mixtral's `sliding_window`, Qwen3's `use_sliding_window` or a `sliding_attention`
layer type), router jitter, Qwen3-MoE's `decoder_sparse_step` other than 1 and
`mlp_only_layers` other than the first k layers (dense layers among the experts), a shared
expert. The training recipe's MoE
keys (aux_loss_coeff, bias_update_rate, capacity_factor) stay the --config's, as the
learning rate does.
"""

from mtnlg_jax.interop import hf_llama
from mtnlg_jax.interop.hf_llama import HFFormatError

# model_type -> the class, and the reverse for export
CLASSES = {
    'qwen3': 'Qwen3ForCausalLM',
    'mixtral': 'MixtralForCausalLM',
    'qwen3_moe': 'Qwen3MoeForCausalLM',
}
MODEL_TYPES = {name: model_type for model_type, name in CLASSES.items()}


def model_type(hf_config):
    """'qwen3', 'mixtral' or 'qwen3_moe' of a config.json; None: none of these."""
    if hf_config.get('model_type') in CLASSES:
        return hf_config['model_type']
    named = [MODEL_TYPES[a] for a in hf_config.get('architectures') or () if a in MODEL_TYPES]
    return named[0] if named else None


def is_variant(hf_config):
    return model_type(hf_config) is not None


def _refuse_what_we_cannot_represent(hf_config, kind):
    def refuse(key, why):
        raise HFFormatError(f'config.json {key} = {hf_config[key]!r}: {why}')

    if hf_config.get('sliding_window') is not None and kind == 'mixtral':
        refuse('sliding_window', 'no sliding-window attention here (null only)')
    if hf_config.get('use_sliding_window'):
        refuse('use_sliding_window', 'no sliding-window attention here')
    if any(t != 'full_attention' for t in hf_config.get('layer_types') or ()):
        refuse('layer_types', 'full_attention layers only')
    if hf_config.get('router_jitter_noise'):
        refuse('router_jitter_noise', 'the router has no jitter here (0 only)')
    if hf_config.get('decoder_sparse_step', 1) != 1:
        refuse('decoder_sparse_step', 'every layer is a mixture of experts here (1 only)')
    dense = hf_config.get('mlp_only_layers') or []
    if dense and (kind != 'qwen3_moe' or dense != list(range(len(dense)))):
        refuse('mlp_only_layers', 'dense layers only ahead of the experts here (0 .. k - 1)')
    if len(dense) >= hf_config.get('num_hidden_layers', 0):
        refuse('mlp_only_layers', 'no layer left for the experts')
    for key in ('shared_expert_intermediate_size', 'n_shared_experts'):
        if hf_config.get(key):
            refuse(key, 'no shared expert in Mixtral or Qwen3-MoE')


def _integer(hf_config, *keys):
    """The first of `keys` config.json has, a positive integer; HFFormatError otherwise."""
    for key in keys:
        if key in hf_config:
            value = hf_config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HFFormatError(f'config.json {key} = {value!r}: a positive integer')
            return value
    raise HFFormatError(f'config.json has no integer {" or ".join(keys)}')


def moe_keys(hf_config, kind):
    """model.moe of a Mixtral or Qwen3-MoE config.json (a dict)."""
    experts = _integer(hf_config, 'num_local_experts', 'num_experts')
    top_k = _integer(hf_config, 'num_experts_per_tok')
    if top_k > experts:
        raise HFFormatError(f'config.json num_experts_per_tok = {top_k} > {experts} experts')
    if kind == 'mixtral':
        width, renormalise = _integer(hf_config, 'intermediate_size'), True
    else:
        width = _integer(hf_config, 'moe_intermediate_size')
        renormalise = bool(hf_config.get('norm_topk_prob', False))
    return dict(
        experts=experts,
        top_k=top_k,
        ffn_hidden=width,
        shared_experts=0,
        shared_ffn_hidden=0,
        dense_layers=len(hf_config.get('mlp_only_layers') or []),
        router='softmax',
        norm_top_k=renormalise,
    )


def model_keys(hf_config):
    """The `config.model` keys a Qwen3, Mixtral or Qwen3-MoE config.json fixes (a dict)."""
    kind = model_type(hf_config)
    if kind is None:
        raise HFFormatError(f'not Qwen3, Mixtral or Qwen3-MoE ({hf_config.get("model_type")!r})')
    _refuse_what_we_cannot_represent(hf_config, kind)
    as_llama = dict(hf_config, model_type='llama', architectures=['LlamaForCausalLM'])
    keys = hf_llama.model_keys(as_llama)
    keys['qk_norm'] = kind != 'mixtral'
    if kind != 'qwen3':
        keys['moe'] = moe_keys(hf_config, kind)
    return keys


def block_keys():
    return hf_llama.block_keys()


def model_defaults(hf_config):
    return hf_llama.model_defaults(hf_config)


def max_seq_len(hf_config):
    return hf_llama.max_seq_len(hf_config)


def unexportable(model_cfg):
    """Why a Llama-block model with q/k norms or experts has no Hugging Face class (a line
    naming the key), or None."""
    name = hf_llama.architecture(model_cfg)
    if model_cfg.bias:
        return f'model.bias: {name} has no projection biases'
    moe = model_cfg.moe
    if not moe.experts:
        return None
    why = {
        'router': (moe.router != 'softmax', 'routes by softmax'),
        'shared_experts': (moe.shared_experts > 0, 'has no shared expert'),
        'dense_layers': (
            moe.dense_layers > 0 and name == 'MixtralForCausalLM',
            'has no dense layers (Qwen3-MoE has: model.qk_norm)',
        ),
        'norm_top_k': (
            name == 'MixtralForCausalLM' and not moe.norm_top_k,
            'always renormalises (Qwen3-MoE may not: model.qk_norm)',
        ),
        'routed_scale': (moe.get('routed_scale', 1.0) != 1.0, 'scales no routed weight'),
    }
    for key, (refused, reason) in why.items():
        if refused:
            return f'model.moe.{key} = {moe[key]!r}: {name} {reason}'
    return None


def check_router_bias(model_cfg, router_bias):
    """None, or why the checkpoint's router_bias (layers, experts) has no place in the
    model's class: it has moved (model.moe.bias_update_rate > 0 at some step), and Mixtral
    and Qwen3-MoE choose experts by the scores alone."""
    moved = float(abs(router_bias).max()) if router_bias.size else 0.0
    if not moved:
        return None
    return (
        f'the router bias (model.moe.bias_update_rate) has moved, up to {moved:.3g}: '
        f'{hf_llama.architecture(model_cfg)} has none, so it would choose other experts'
    )


def hf_config_of(model_cfg, bos_id=None, eos_id=None, dtype='float32'):
    """The config.json (a dict, the published checkpoints' layout) of a resolved config.model
    with q/k norms or experts (check `unexportable` first)."""
    name = hf_llama.architecture(model_cfg)
    config = hf_llama.hf_config_of(model_cfg, bos_id, eos_id, dtype)
    del config['mlp_bias']
    config.update(architectures=[name], model_type=MODEL_TYPES[name])
    moe = model_cfg.moe
    if name == 'MixtralForCausalLM':
        del config['attention_bias']
        config.update(
            intermediate_size=moe.ffn_hidden or model_cfg.ffn_hidden,
            num_local_experts=moe.experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            router_aux_loss_coef=moe.aux_loss_coeff,
            output_router_logits=False,
        )
    else:
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=model_cfg.num_layers)  # fmt: skip
    if name == 'Qwen3MoeForCausalLM':
        config.update(
            num_experts=moe.experts,
            moe_intermediate_size=moe.ffn_hidden or model_cfg.ffn_hidden,
            norm_topk_prob=moe.norm_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(moe.dense_layers)),
            router_aux_loss_coef=moe.aux_loss_coeff,
            output_router_logits=False,
        )
    if moe.experts:
        config['num_experts_per_tok'] = moe.top_k
    return config
