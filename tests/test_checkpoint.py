"""Checkpoints in process: what restore takes, what it refuses, what it never deletes, and
the non-finite step guard of the train step. (The command-line behaviour is in
test_resume.py and test_faults.py.)"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.train import faults, resume
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.data import batch as batch_lib
from mtnlg_jax.train import step as step_lib
from support import LLAMA_BLOCK, SEQ_LEN, assert_trees_close, layout, random_batches, small_config


@functools.cache
def initial_state(**layout_and_model):
    """(config, initial state) of a small model; cached: compiling init costs seconds."""
    config = small_config(**layout_and_model)
    _, setup = layout(config)
    return config, state_lib.init_state(config, setup)


def saved_run(workdir, steps=(1, 2), **layout_and_model):
    """A small model's initial state saved at `steps` in workdir; returns (config, state)."""
    config, state = initial_state(**layout_and_model)
    checkpoints = checkpoint_lib.Checkpoints(workdir)
    for step in steps:
        checkpoints.save(step, state, resume.checkpoint_meta(config, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()
    return config, jax.device_get(state)


def restore_into(workdir, config):
    """restore_or_init of `config`'s layout on workdir; returns (state, counters, log lines)."""
    mesh, setup = layout(config)
    lines = []
    with jax.set_mesh(mesh):
        checkpoints = checkpoint_lib.Checkpoints(workdir)
        position = resume.restore_or_init(config, setup, checkpoints, log=lines.append)
        checkpoints.close()
    return jax.device_get(position.state), position.counters, lines


def step_directory(workdir, step):
    return workdir / 'checkpoints' / str(step)


def test_restore_takes_the_newest_and_names_it(tmp_path):
    config, saved = saved_run(tmp_path, steps=(1, 2))
    restored, counters, lines = restore_into(tmp_path, config)
    assert_trees_close(restored, saved, atol=0)
    assert counters == dict(samples_consumed=0, tokens_seen=0, skipped_steps=0)
    assert 'from step 2' in lines[0] and 'newest complete' in lines[0]


def test_the_padded_vocabulary_follows_the_tensor_size(tmp_path):
    # vocab 300 pads to 384 rows under tensor 1 and to 1024 under tensor 8.
    config, saved = saved_run(tmp_path, vocab_size=300)
    other = small_config(data=1, tensor=8, micro_steps=2, vocab_size=300)
    restored, _, _ = restore_into(tmp_path, other)
    assert saved['params']['token_embed'].shape == (384, 64)
    assert restored['params']['token_embed'].shape == (1024, 64)
    np.testing.assert_array_equal(
        restored['params']['token_embed'][:300], saved['params']['token_embed'][:300]
    )
    np.testing.assert_array_equal(
        restored['params']['blocks']['mlp']['in_kernel'],
        saved['params']['blocks']['mlp']['in_kernel'],
    )


def test_another_model_shape_names_the_first_mismatched_array_and_both_shapes(tmp_path):
    saved_run(tmp_path, hidden=64)
    before = sorted(os.listdir(tmp_path / 'checkpoints'))
    with pytest.raises(checkpoint_lib.CheckpointError) as error:
        restore_into(tmp_path, small_config(hidden=32))
    message = str(error.value)
    assert '\n' not in message
    assert 'params/blocks/attention/out_bias' in message  # parameters are checked first
    assert '(2, 64)' in message and '(2, 32)' in message
    assert sorted(os.listdir(tmp_path / 'checkpoints')) == before


def test_a_corrupted_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, capsys):
    config, saved = saved_run(tmp_path, steps=(1, 2))
    corrupted = step_directory(tmp_path, 2)
    for data_file in (corrupted / 'state' / 'd').iterdir():
        data_file.write_bytes(b'not an array')
    restored, _, lines = restore_into(tmp_path, config)
    assert 'from step 1' in lines[0]
    assert f'skipping unreadable checkpoint {corrupted}' in capsys.readouterr().err
    assert_trees_close(restored, saved, atol=0)
    assert corrupted.exists()  # skipped, not deleted


def test_no_readable_checkpoint_is_an_error_and_nothing_is_deleted(tmp_path):
    config, _ = saved_run(tmp_path, steps=(1, 2))
    for step in (1, 2):
        (step_directory(tmp_path, step) / 'state' / '_METADATA').write_text('{not json')
    with pytest.raises(checkpoint_lib.CheckpointError, match='no usable checkpoint.*2, 1'):
        restore_into(tmp_path, config)
    assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1', '2']


def test_saving_over_a_skipped_checkpoint_sets_it_aside_instead_of_deleting_it(tmp_path):
    config, saved = saved_run(tmp_path, steps=(1, 2))
    (step_directory(tmp_path, 2) / 'state' / '_METADATA').write_text('{not json')
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    checkpoints.save(2, saved, resume.checkpoint_meta(config, resume.fresh_counters()))
    checkpoints.wait()
    assert checkpoints.all_steps() == [1, 2]
    checkpoints.close()
    assert (tmp_path / 'checkpoints' / '2.unusable' / 'state').is_dir()
    restored, _, lines = restore_into(tmp_path, config)
    assert 'from step 2' in lines[0]


def test_an_incomplete_save_is_not_a_step_and_restore_says_it_ignored_it(tmp_path):
    config, _ = saved_run(tmp_path, steps=(1,))
    # What a process killed mid-save leaves behind: orbax's temporary directory.
    partial = tmp_path / 'checkpoints' / f'2{checkpoint_lib.TMP_MARKER}-123'
    (partial / 'state').mkdir(parents=True)
    _, _, lines = restore_into(tmp_path, config)
    assert 'from step 1' in lines[0] and str(partial) in lines[0]


def test_init_from_takes_another_runs_parameters_under_another_layout(tmp_path):
    _, saved = saved_run(tmp_path / 'other', steps=(3,))
    config = small_config(data=2, tensor=4)
    config.checkpoint.init_from = str(tmp_path / 'other')
    config.train.seed = 99  # its own initialisation would differ
    restored, counters, lines = restore_into(tmp_path / 'new', config)
    assert_trees_close(restored['params'], saved['params'], atol=0)
    assert int(restored['step']) == 0 and counters['samples_consumed'] == 0
    assert 'initialised  parameters from step 3' in lines[0]


def longer_stage(config, seq_len, context, **layout_and_model):
    """Llama 3's next long-context stage of `config` (docs/training.md): seq_len tokens split
    over `context` x tensor with sequence parallelism, rope's llama3 scaling from the
    previous stage's length."""
    config = config_lib.inputs_of(small_config(**layout_and_model))
    config.mesh.context = context
    config.model.update(dict(seq_len=seq_len, sequence_parallel=True))
    config.model.rope_scaling.update(dict(type='llama3', original_context=SEQ_LEN))
    return config_lib.resolve(config, 8)


def test_init_from_a_shorter_sequence_starts_a_longer_one_on_context_parallelism(tmp_path):
    """Continued pretraining: a Llama run at seq 32 (no rope scaling) on data 2 x tensor 4
    starts a new run at seq 128 on context 2 x tensor 2 x data 2 with rope's llama3 scaling:
    the parameters are the source's, and two train steps on one batch of 128 tokens a row
    lower its loss. (A resume that changes model.seq_len is refused: test_identity.py.)"""
    block = dict(LLAMA_BLOCK, rope_scaling=dict(type='none'))
    config = small_config(data=2, tensor=4, **block)
    _, setup = layout(config)
    source = state_lib.init_state(config, setup)
    checkpoints = checkpoint_lib.Checkpoints(tmp_path / 'short')
    checkpoints.save(3, source, resume.checkpoint_meta(config, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()
    saved = jax.device_get(source['params'])
    long = longer_stage(config, 4 * SEQ_LEN, context=2, data=2, tensor=2, **block)
    long.checkpoint.init_from = str(tmp_path / 'short')
    long.train.seed = 99  # its own initialisation would differ
    mesh, long_setup = layout(long)
    pieces = [random_batches(1, seed=s)[0][:, :SEQ_LEN] for s in range(5)]
    batch = np.concatenate(pieces, 1)[:, : 4 * SEQ_LEN + 1].astype(np.int32)
    tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 2), mesh)
    lines = []
    with jax.set_mesh(mesh):
        new = checkpoint_lib.Checkpoints(tmp_path / 'long')
        position = resume.restore_or_init(long, long_setup, new, log=lines.append)
        new.close()
        restored = jax.device_get(position.state['params'])
        train_step = step_lib.make_train_step(long, long_setup)
        state, losses = position.state, []
        for i in range(2):
            seen = jnp.float32((i + 1) * batch[:, 1:].size)
            state, metrics = train_step(state, tokens, rows, seen)
            losses.append(float(metrics['loss']))
    assert 'initialised  parameters from step 3' in lines[0]
    assert_trees_close(restored, saved, atol=0)
    assert np.isfinite(losses).all() and losses[1] < losses[0], losses


def test_a_non_finite_step_leaves_parameters_and_optimizer_state_unchanged():
    config, initial = initial_state()
    mesh, setup = layout(config)
    batch = random_batches(1)[0].astype(np.int32)
    with jax.set_mesh(mesh):
        state = jax.tree.map(jnp.copy, initial)  # the step donates its input
        before = jax.device_get(state)
        tokens, rows = batch_lib.place_batch(*batch_lib.to_micro_steps(batch, 2), mesh)
        poisoned = step_lib.make_train_step(config, setup, inject='nan')
        state, metrics = poisoned(state, tokens, rows, jnp.float32(512))
    after = jax.device_get(state)
    assert int(metrics['skipped']) == 1 and not np.isfinite(float(metrics['loss']))
    assert_trees_close(after['params'], before['params'], atol=0)
    assert_trees_close(after['opt_state'], before['opt_state'], atol=0)
    assert int(after['step']) == 1  # the batch is consumed


def test_the_step_guard_stops_after_the_limit_of_consecutive_skips():
    counter = faults.StepGuard(max_consecutive_skips=2)
    for step, skipped in enumerate([1, 0, 1, 1, 0], start=1):
        counter.push(step, dict(skipped=jnp.int32(skipped), loss=jnp.float32(1.0)))
        if step == 3:
            assert counter.error is None  # step 3 is read only once step 4 is pushed
    counter.flush()
    assert counter.total == 3
    assert counter.error and 'up to step 4' in counter.error


def test_the_step_guard_flags_a_loss_above_the_factor_times_the_running_mean():
    guard = faults.StepGuard(max_consecutive_skips=3, spike_factor=2.0, spike_window=3)
    for step, loss in enumerate([4.0, 3.0, 2.0, 5.9, 6.1, 1.0], start=1):
        guard.push(step, dict(skipped=jnp.int32(0), loss=jnp.float32(loss)))
    guard.flush()
    # Each loss is compared with the mean of the three before it: 5.9 < 2 x 3, 6.1 < 2 x 3.63.
    assert guard.spike is None
    guard.push(7, dict(skipped=jnp.int32(0), loss=jnp.float32(30.0)))
    guard.flush()
    assert guard.spike[0] == 7 and guard.spike[1] == 30.0
