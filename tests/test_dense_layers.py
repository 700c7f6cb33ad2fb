"""Dense layers ahead of the experts (model.moe.dense_layers, model/gpt.py's dense_blocks):
the first k layers keep the dense MLP in a stack of their own; the loss, every gradient leaf
and the side values (moe_loads' first k rows zero) under data x expert x tensor and
pipelined (1F1B, stage x expert x tensor) equal one device's; the counts are the tree's; a
checkpoint restores under a pipelined layout; KV-cache decoding runs both stacks; bad input
is one line (test_moe.py's BAD)."""

import jax
import numpy as np
import pytest

import support
import test_checkpoint
import test_expert_parallel
import test_llama_block
import test_moe
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.model import counts, gpt
from mtnlg_jax.model import moe as moe_lib
from mtnlg_jax.train import resume

# Three layers, the first dense; the router bias moves by the MoE layers' loads.
MODEL = dict(num_layers=3, moe={**test_expert_parallel.MOE, 'dense_layers': 1})
CASES = {
    'd2e2t2': dict(data=2, expert=2, tensor=2),
    # five layers: one dense, two MoE a stage (the first stage runs the dense one beside them)
    's2e2t2-1f1b': dict(num_layers=5, stage=2, expert=2, tensor=2, micro_steps=4),
}


@pytest.mark.parametrize('case', CASES)
def test_loss_gradients_and_values_with_dense_layers_equal_one_devices(case):
    """The dense stack's gradients among the leaves; no token reaches an expert in layer 0."""
    layout = dict(CASES[case])
    model = {**MODEL, 'num_layers': layout.pop('num_layers', MODEL['num_layers'])}
    values = test_moe.assert_layout_equals_one_device(model, layout, test_expert_parallel.RELATIVE)
    loads = values[moe_lib.LOADS]
    assert loads.shape[0] == model['num_layers'] and not loads[0].any()
    tokens = support.GLOBAL_BATCH * support.SEQ_LEN * test_moe.MOE['top_k']
    np.testing.assert_array_equal(loads[1:].sum(-1), tokens)


def test_the_dense_stack_holds_the_first_layers_and_the_counts_are_the_trees():
    cfg = support.small_config(**MODEL).model
    params = gpt.split(jax.eval_shape(lambda: gpt.create(cfg, 0)))[1]
    assert params['dense_blocks']['mlp']['in_kernel'].shape == (1, cfg.hidden, cfg.ffn_hidden)
    assert 'mlp' not in params['blocks'] and params['blocks']['moe']['in_kernel'].shape[0] == 2
    total = counts.count_params(params)
    assert counts.param_count(cfg) == total
    experts = test_moe.MOE['experts'] - test_moe.MOE['top_k']
    assert counts.active_params(cfg, total) == total - 2 * experts * counts.expert_params(cfg)


def test_a_checkpoint_with_dense_layers_restores_under_a_pipelined_layout(tmp_path):
    """Saved after a step on one device (the router bias moved), restored under stage 2 x
    expert 2 x tensor 2: the same parameters and buffers in layer order."""
    config = support.small_config(**{**MODEL, 'num_layers': 5})
    _, state = support.train_losses(config, support.random_batches(1))
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    checkpoints.save(1, state, resume.checkpoint_meta(config, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()
    saved = jax.device_get(state)
    assert np.abs(saved['buffers']['blocks']['moe']['router_bias']).max() > 0
    layout = dict(CASES['s2e2t2-1f1b'])
    other = support.small_config(**{**MODEL, **layout})
    restored, _, _ = test_checkpoint.restore_into(tmp_path, other)
    for part in ('params', 'buffers'):
        in_order = support.in_layer_order(other, restored[part])
        support.assert_trees_close(in_order, saved[part], atol=0)


def test_kv_cache_decoding_runs_the_dense_layers_then_the_experts():
    test_llama_block.assert_cached_decoding_equals_full(
        support.small_config(init_std=0.3, **support.LLAMA_BLOCK, **MODEL).model
    )
