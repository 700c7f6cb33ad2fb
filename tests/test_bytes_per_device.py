"""The banner's bytes per device against the arithmetic of Megatron tensor parallelism and
ZeRO-1, counted by hand from the model's shapes."""

import jax

import support
from mtnlg_jax.model import counts
from mtnlg_jax.parallel import footprint
from mtnlg_jax.train import state as state_lib


def _hand_counts(model):
    """(parameters split over tensor, parameters replicated over tensor) of the small GPT."""
    h, f, v, s, layers = model.hidden, model.ffn_hidden, model.padded_vocab, model.seq_len, 2
    split = v * h + layers * (h * 3 * h + 3 * h + h * h + h * f + f + f * h)
    replicated = s * h + 2 * h + layers * (h + h + 4 * h)  # positions, norms, output biases
    return split, replicated


def test_bytes_per_device_match_tensor_and_zero_arithmetic():
    data, tensor = 4, 2
    config = support.small_config(data=data, tensor=tensor, compute_dtype='bfloat16')
    _, setup = support.layout(config)
    split, replicated = _hand_counts(config.model)
    assert counts.count_params(setup.abstract_state['params']) == split + replicated

    held = footprint.bytes_per_device(config, setup)
    # Compute copy: 2 bytes (bf16) per parameter, tensor-parallel ones split over tensor.
    assert held['parameters'] == 2 * (split // tensor + replicated)
    # fp32 gradient accumulators as the compute copy: each replica sums its own micro-steps
    # until the step's reduce-scatter over data.
    assert held['gradients'] == 4 * (split // tensor + replicated)
    # ZeRO-1: fp32 master + two moments split over data as well (every leaf of this model has
    # a dimension that data, or data x tensor, divides).
    assert held['optimizer'] == 3 * 4 * (split // tensor + replicated) // data


def test_bytes_per_device_of_actual_arrays_match_the_plan():
    config = support.small_config(data=4, tensor=2)
    mesh, setup = support.layout(config)
    state = state_lib.init_state(config, setup)
    device = jax.devices()[0]
    master = sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(state['params'])
        for shard in leaf.addressable_shards
        if shard.device == device
    )
    assert 3 * master == footprint.bytes_per_device(config, setup)['optimizer']
