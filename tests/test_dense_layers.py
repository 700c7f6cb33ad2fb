"""Dense layers ahead of the experts (model.moe.dense_layers, model/gpt.py's dense_blocks):
the first k layers keep the dense MLP in a stack of their own, which the counts read; KV-cache
decoding runs both stacks; GPipe's order is refused in one line. Their layouts against one
device and a checkpoint restored under other layouts: test_expert_parallel.py's cases with a
dense layer; the other refusals: test_moe.py's BAD."""

import jax
import pytest

import support
import test_expert_parallel
import test_llama_block
import test_moe
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import counts, gpt

MODEL = test_expert_parallel.DENSE_FIRST  # three layers, the first dense


def test_the_dense_stack_holds_the_first_layers_and_the_counts_are_the_trees():
    """dense_blocks holds layer 0 with the dense MLP, blocks the two MoE layers; the planner's
    count is the tree's, and the active parameters leave out the MoE layers' unchosen experts."""
    cfg = support.small_config(**MODEL).model
    params = gpt.split(jax.eval_shape(lambda: gpt.create(cfg, 0)))[1]
    assert params['dense_blocks']['mlp']['in_kernel'].shape == (1, cfg.hidden, cfg.ffn_hidden)
    assert 'mlp' not in params['blocks'] and params['blocks']['moe']['in_kernel'].shape[0] == 2
    total = counts.count_params(params)
    assert counts.param_count(cfg) == total
    unchosen = test_moe.MOE['experts'] - test_moe.MOE['top_k']
    assert counts.active_params(cfg, total) == total - 2 * unchosen * counts.expert_params(cfg)


def test_kv_cache_decoding_runs_the_dense_layers_then_the_experts():
    cfg = support.small_config(init_std=0.3, **support.LLAMA_BLOCK, **MODEL).model
    test_llama_block.assert_cached_decoding_equals_full(cfg, length=9)


def test_gpipe_with_dense_layers_is_one_line_naming_the_key():
    config = config_lib.inputs_of(support.small_config(**MODEL))
    config.mesh.stage, config.pipeline.schedule = 2, 'gpipe'
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.resolve(config, 2)
    message = str(error.value)
    assert 'model.moe.dense_layers: 1 dense layers run on the 1f1b' in message, message
