"""Pipeline stages of unequal depth (pipeline.first_stage_layers / last_stage_layers): the
layer arithmetic (Llama 3 405B's 7, 8 x 14, 7), 1F1B (a Llama block, as the 405B's) and
interleaved (GPT) layouts equal one device (fp32, per leaf), padding slots stay zero and get
no gradient, checkpoints hold exactly the model's layers and restore under an even layout and
back, and bad splits are one error."""

import jax
import numpy as np
import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.parallel import stage_order
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import report
from mtnlg_jax.train import resume
from mtnlg_jax.train import state as state_lib

LAYERS = 6


def test_llama3_405bs_stages_hold_7_then_8_then_7_layers():
    layers = stage_order.StageLayers(126, 16, 1, first=7, last=7)
    assert layers.per_stage == (7,) + (8,) * 14 + (7,)
    assert layers.slots == 8 and layers.stored_layers == 128 and layers.padded
    held = layers.storage()
    assert sorted(held[held >= 0]) == list(range(126))
    assert list(np.nonzero(held < 0)[0]) == [7, 127]  # the first and the last stage's 8th
    interleaved = stage_order.StageLayers(10, 2, 2, first=2, last=8)
    pad = [-1] * 3  # stage 0: one layer a chunk, stage 1: four
    assert interleaved.storage().tolist() == [0, *pad, 5, *pad, 1, 2, 3, 4, 6, 7, 8, 9]
    # 7 layers in 2 chunks: the embedding's and the head's chunks hold the 3
    sizes = stage_order.StageLayers(126, 16, 2, first=7, last=7).chunk_sizes
    assert sizes[:, 0].tolist() == [3, 4] and sizes[:, -1].tolist() == [4, 3]
    assert (sizes[:, 1:-1] == 4).all()


def test_the_stored_order_round_trips_and_pads_with_zeros():
    layers = stage_order.StageLayers(LAYERS, 4, 1, first=1, last=1)
    tree = {'blocks': np.arange(LAYERS, dtype=np.float32) + 1, 'other': np.ones(3)}
    stored = stage_order.to_schedule_order(tree, layers)
    assert stored['blocks'].tolist() == [1, 0, 2, 3, 4, 5, 6, 0]
    back = stage_order.to_layer_order(stored, layers)
    np.testing.assert_array_equal(back['blocks'], tree['blocks'])


def _config(
    stage, repeats=1, schedule='1f1b', first=1, last=1, micro_steps=4, tensor=1, steady=False,
    fused=False, **model,
):  # fmt: skip
    config = support.small_config(
        tensor=tensor, micro_steps=micro_steps, num_layers=LAYERS, **model
    )
    config = config_lib.inputs_of(config)
    config.mesh.stage = stage
    config.pipeline.update(
        repeats=repeats, schedule=schedule, first_stage_layers=first, last_stage_layers=last,
        steady_tick=steady, fused_accumulation=fused,
    )  # fmt: skip
    return config_lib.resolve(config, stage * tensor)


BLOCKS = {'gpt': {}, 'llama': support.LLAMA_BLOCK}
# test_llama_block.py's ZB-H1 case, carried by the ZB-H1 layout here (one compile for both):
# tensor 2 (2 of the 4 key/value heads a rank), sequence parallel, full recompute, the block
# on two pieces of each sequence; the one-device reference runs none of them. ZB-V's Llama
# case too: its V of 1 + 1 and 2 + 2 layers (padding slots on stage 0). It, ZB-H1's and the
# uneven chunks run the steady tick (pipeline.steady_tick: the tick as one switch over slot
# pairs; zbv's hand-offs both ways); test_side_values.py holds zbv by slot to one device.
LLAMA_TENSOR = dict(tensor=2, sequence_parallel=True, remat='full', sequence_pieces=2)


@pytest.fixture(scope='module')
def one_device():
    """{block: (batch, (params, loss, grads))} on one device, computed when first asked for."""
    batch, found = support.random_batches(1)[0], {}

    def of(block):
        if block not in found:
            config = support.small_config(num_layers=LAYERS, hidden_dropout=0.1, **BLOCKS[block])
            found[block] = batch, support.gradients(config, batch, step=5)
        return found[block]

    return of


@pytest.mark.parametrize(
    'stage, repeats, schedule, first, last, block, more',
    [
        (4, 1, '1f1b', 1, 1, 'llama', {}),  # Llama 3 405B's shape in small
        (2, 2, 'interleaved', 2, 4, 'gpt', {}),  # the 405B's engine: by slot, unfused
        (2, 2, 'interleaved', 2, 4, 'gpt', dict(fused=True)),  # chained.py's, padded
        (2, 2, 'interleaved', 3, 3, 'gpt', dict(steady=True)),
        (4, 1, 'zbh1', 1, 1, 'llama', dict(LLAMA_TENSOR, steady=True)),
        # the V: chunks 0 and 3 on stage 0
        (2, 2, 'zbv', 2, 4, 'llama', dict(LLAMA_TENSOR, steady=True)),
    ],
    ids=[
        '1f1b-1-2-2-1-llama',
        'interleaved-2-4',
        'interleaved-2-4-fused',
        'interleaved-3-3-uneven-chunks-steady',
        'zbh1-llama-t2-sp-pieces-steady',
        'zbv-llama-2-4-t2-sp-pieces-steady',
    ],
)
def test_an_unequal_layout_equals_one_device(
    one_device, stage, repeats, schedule, first, last, block, more
):
    """Initial parameters (bit for bit), loss and every gradient per leaf, relative to its
    scale, with dropout on (each layer keeps its own masks wherever it runs); the stored
    padding slots stay zero and get zero gradients."""
    batch, (params_one, loss_one, grads_one) = one_device(block)
    config = _config(
        stage, repeats, schedule, first, last, hidden_dropout=0.1, **BLOCKS[block], **more
    )
    params, loss, grads = support.gradients(config, batch, step=5)
    support.assert_trees_close(params, params_one, atol=0.0)
    np.testing.assert_allclose(loss, loss_one, rtol=1e-6)
    support.assert_gradients_close(grads, grads_one)
    _, setup = support.layout(config)
    padding = setup.stage_layers.storage() < 0
    assert padding.sum() == setup.stage_layers.stored_layers - LAYERS > 0


def test_checkpoints_hold_the_models_layers_and_restore_under_an_even_layout(tmp_path):
    """Saved from 1, 2, 2, 1 layers on 4 stages: the checkpoint's blocks have the model's 6
    layers; an even 2-stage layout restores the initial parameters of one device, and the
    unequal layout restores its own state back, padding slots zero."""
    config = _config(4)
    mesh, setup = support.layout(config)
    with jax.set_mesh(mesh):
        state = state_lib.init_state(config, setup)
        stored = jax.device_get(state)
        checkpoints = checkpoint_lib.Checkpoints(tmp_path)
        in_layer_order = state_lib.pipeline_order(config, setup, to='layer')
        meta = resume.checkpoint_meta(config, resume.fresh_counters())
        checkpoints.save(1, in_layer_order(state), meta)
        checkpoints.wait()
        checkpoints.close()
    saved = jax.tree.leaves(jax.device_get(in_layer_order(state))['params']['blocks'])
    assert {leaf.shape[0] for leaf in saved} == {LAYERS}
    for leaf in jax.tree.leaves(stored['params']['blocks']):
        assert leaf.shape[0] == 8 and not leaf[setup.stage_layers.storage() < 0].any()
    even = support.small_config(stage=2, micro_steps=4, num_layers=LAYERS)
    restored = _restore(tmp_path, even)
    expected = support.initial_params(support.small_config(num_layers=LAYERS))
    support.assert_trees_close(support.in_layer_order(even, restored['params']), expected, 0)
    back = _restore(tmp_path, config)
    support.assert_trees_close(back, stored, atol=0.0)


def _restore(workdir, config):
    mesh, setup = support.layout(config)
    with jax.set_mesh(mesh):
        checkpoints = checkpoint_lib.Checkpoints(workdir)
        position = resume.restore_or_init(config, setup, checkpoints, log=lambda _: None)
        checkpoints.close()
    return jax.device_get(position.state)


@pytest.mark.parametrize(
    'overrides, words',
    [
        (dict(first=3, last=2), 'do not share evenly'),
        (dict(first=1, last=1, repeats=2), 'a stage of 1 layer cannot hold 2 chunks'),
        (dict(first=1, last=1, schedule='gpipe'), 'not gpipe'),
    ],
)
def test_bad_stage_layers_are_one_error_naming_the_key(overrides, words):
    with pytest.raises(config_lib.ConfigError, match=words) as error:
        _config(4, **overrides)
    assert error.value.key == 'pipeline.first_stage_layers'


def test_padding_slots_run_a_layer_and_the_compile_counts_it():
    """Compiled by XLA:CPU: 1, 2, 2, 1 layers on 4 stages run 8 layer slots, so the step does
    the matmul FLOPs of the 8-layer model unpipelined, not the 6-layer one's: a padding slot
    runs its zero layer and drops the result (model/gpt.py's apply_block_stack; skipping it
    would save no tick), and the plan's compiled FLOPs count that work as what it is."""
    eight = _matmul_flops(support.small_config(num_layers=8, hidden=128))
    six = _matmul_flops(support.small_config(num_layers=LAYERS, hidden=128))
    unequal = _matmul_flops(_config(4, hidden=128))
    assert unequal == pytest.approx(eight, rel=0.02), (unequal, eight, six)
    assert unequal > 1.1 * six


def _matmul_flops(config):
    """Matmul FLOPs of one step, all devices together, from the compiled HLO."""
    compiled, _, info = compile_lib.compile_train_step(config)
    plan = report.add_compiled(report.make_plan(config), config, compiled, info)
    return plan['compiled']['flops'] * info['mesh'].devices.size
