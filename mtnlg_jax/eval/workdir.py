"""A trained model out of a workdir, on whatever mesh the evaluation or generation asks for.

A workdir (mtnlg_jax/run/rundir.py) holds config.json and orbax checkpoints that restore onto any
layout. Inference picks its own layout (data x tensor, stage 1: the blocks are not pipelined
for inference), resolves only the mesh and model sections of the run's inputs (its training
batch, schedule and data settings play no part), keeps the checkpoint's padded vocabulary
(it depends on the tensor size of the run that wrote it; a multiple of 128 x tensor divides
over any tensor size up to 128), and reads the parameters alone, with the model's buffers
where it has any (model/buffers.py: a router's bias routes at inference too): the optimizer
moments, twice their bytes, stay on disk.
"""

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax import config as config_lib
from mtnlg_jax.config.keys import mesh_devices
from mtnlg_jax.model import buffers as buffers_lib
from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import rules
from mtnlg_jax.parallel.mesh import mesh_from_config
from mtnlg_jax.run.rundir import RunDir, RunDirError


class WorkdirError(ValueError):
    """A workdir without a config or checkpoint, a step it does not have, or a checkpoint
    that does not fit its config."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ml_collections.ConfigDict  # the run's config, with the inference mesh
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: dict  # compute-dtype parameters laid out by the rule table, the model's buffers
    # (fp32) beside them where it has any: what gpt.merge(graphdef, params) takes
    step: int


def inference_config(saved, data=None, tensor=None, context=1, expert=1):
    """The config of a run (config.json as a dict) resolved for an inference mesh of
    data x expert x context x tensor devices (defaults: the run's own data and tensor,
    context 1, whatever the run's: a prefill splits over `context` only where asked,
    eval/generation.py; expert 1, whatever the run's: each tensor group holds every expert,
    or `expert` ranks split a mixture of experts' experts, checkpoints restoring onto any
    layout); ConfigError if the model cannot be laid out so."""
    config = config_lib.inputs_of(saved.get('inputs') or saved)
    data = saved['mesh']['data'] if data is None else data
    tensor = saved['mesh']['tensor'] if tensor is None else tensor
    config.mesh.update(dict(data=data, stage=1, expert=expert, context=context, tensor=tensor))
    # Checkpoints hold the blocks in layer order: no pipeline, whatever the run's schedule.
    config.pipeline.update(dict(repeats=1, schedule='1f1b'))
    config = config_lib.resolve_model(config, data * expert * context * tensor)
    padded_vocab = saved.get('derived', saved)['model'].get('padded_vocab')
    config.model.padded_vocab = padded_vocab or config.model.padded_vocab
    return config


def run_tokenizer(workdir, config, path=None, needed=True):
    """(the tokenizer, its identity record) a read of `workdir` uses: `path` (--tokenizer) or
    the run's data.tokenizer, which must be the tokenizer the run was trained with (its
    identity.json), not only of its size: a tokenizer file replaced since, or another one of
    the same size, is a WorkdirError naming both. needed=False (token files alone are read):
    (None, the run's record) when there is no tokenizer file to open."""
    from mtnlg_jax.data import identity
    from mtnlg_jax.data import tokenizer as tokenizer_lib

    name = '--tokenizer' if path else "the run's data.tokenizer (or --tokenizer)"
    trained = read_identity(workdir).get('tokenizer')
    path = path or config.data.tokenizer
    if not needed and not (path and os.path.exists(path)):
        return None, trained
    if not path and trained is not None:
        raise WorkdirError(
            f'{name}: the run names no tokenizer file, but was trained on ids of '
            f'{identity.describe(trained)}: give that one with --tokenizer'
        )
    try:
        tokenizer = tokenizer_lib.open_tokenizer(path, config.model, name)
    except tokenizer_lib.TokenizerError as e:
        raise WorkdirError(str(e)) from None
    found = identity.record(tokenizer)
    if trained is not None and not identity.same(found, trained):
        raise WorkdirError(
            f'{name} {path} is {identity.describe(found)}, but {workdir} was trained with '
            f'{identity.describe(trained)}: its ids would mean other pieces'
        )
    return tokenizer, found


def read_identity(workdir):
    try:
        return RunDir(workdir).read_identity()
    except RunDirError as e:
        raise WorkdirError(str(e)) from None


def read_saved_config(workdir):
    try:
        return RunDir(workdir).read_config()
    except RunDirError as e:
        raise WorkdirError(str(e)) from None


def checkpoint_step(workdir, step=None):
    """The step to read (default: the newest); WorkdirError if the workdir has none such."""
    steps = RunDir(workdir).saved_steps()
    if not steps or (step is not None and step not in steps):
        raise WorkdirError(
            f'--workdir {workdir}: no checkpoint of step {step if step is not None else "any"} '
            f'in {RunDir(workdir).checkpoints}; it has {steps or "none"}'
        )
    return steps[-1] if step is None else step


def abstract_params(config, device=None):
    """(graphdef, ShapeDtypeStructs of the fp32 parameters, their logical axes); device: the
    mesh's first (the attention kernel)."""
    abstract_model = nnx.eval_shape(lambda: gpt.create(config.model, config.train.seed, device))
    return gpt.split(abstract_model)


@contextlib.contextmanager
def _reading(workdir, step):
    """The workdir's checkpoints, read-only, for a read of `step`: what goes wrong inside is a
    WorkdirError naming the config (a model mismatch) or the checkpoint (unreadable)."""
    checkpoints = checkpoint_lib.Checkpoints(workdir, read_only=True)
    try:
        yield checkpoints
    except checkpoint_lib.CheckpointError as e:
        raise WorkdirError(f'{e} (the config in {RunDir(workdir).config_path})') from None
    except Exception as e:  # truncated, corrupted or not an orbax checkpoint at all
        raise WorkdirError(
            f'--workdir {workdir}: checkpoint {RunDir(workdir).checkpoints}/{step} is '
            f'unreadable ({checkpoint_lib.first_line(e)})'
        ) from None
    finally:
        checkpoints.close()


def layer_reader(workdir, step, config):
    """(read, the fp32 parameters' ShapeDtypeStructs) of checkpoint `step`, read on the host a
    layer at a time with no device (checkpoint/slices.py: an export of a model larger than the
    host's devices); WorkdirError unless the checkpoint reads and fits the config's model.
    read.buffers reads the model's buffers (model/buffers.py) the same way."""
    from mtnlg_jax.checkpoint.slices import LayerReader

    _, params_shapes, _ = abstract_params(config)
    with _reading(workdir, step) as checkpoints:
        checkpoints.check_fits(dict(params=params_shapes), step, partial=True)
        step_dir = os.path.join(RunDir(workdir).checkpoints, str(step))
        read = LayerReader(step_dir)
        read.buffers = LayerReader(step_dir, 'buffers')
    return read, params_shapes


def load(workdir, step=None, data=None, tensor=None, dtype=None, context=1, expert=1):
    """The model of `workdir` at `step` (default: its newest checkpoint) on a data x expert x
    context x tensor mesh of the first devices. dtype: compute dtype (default: the run's).
    WorkdirError or ConfigError, before anything is compiled, if it cannot be read."""
    config = inference_config(read_saved_config(workdir), data, tensor, context, expert)
    if dtype is not None:
        config.model.compute_dtype = dtype
    step = checkpoint_step(workdir, step)
    if jax.process_count() > 1 and mesh_devices(config.mesh) != jax.device_count():
        raise WorkdirError(  # every process must hold part of the mesh it runs
            f'{jax.process_count()} processes: the mesh must use all {jax.device_count()} '
            f'devices, but --data_parallel x --tensor = {config.mesh.data} x '
            f'{config.mesh.tensor}'
        )
    mesh = mesh_from_config(config)
    abstract_model = nnx.eval_shape(
        lambda: gpt.create(config.model, config.train.seed, mesh.devices.flat[0])
    )
    graphdef, params_shapes, logical_axes = gpt.split(abstract_model)
    buffer_shapes, buffer_axes, _ = gpt.buffers(abstract_model)
    shardings = rules.compute_shardings(logical_axes, mesh)
    parts = dict(params=checkpoint_lib.abstract_with_shardings(params_shapes, shardings))
    if buffer_shapes:
        buffer_shardings = rules.compute_shardings(buffer_axes, mesh)
        parts['buffers'] = checkpoint_lib.abstract_with_shardings(buffer_shapes, buffer_shardings)
    with _reading(workdir, step) as checkpoints, jax.set_mesh(mesh):
        restored = checkpoints.restore_parts(parts, step)
    dtype = jnp.dtype(config.model.compute_dtype)
    with jax.set_mesh(mesh):
        params = jax.jit(
            lambda p: jax.tree.map(lambda x: x.astype(dtype), p), out_shardings=shardings
        )(restored['params'])
    params = buffers_lib.beside(params, restored.get('buffers', {}))
    return LoadedModel(config=config, mesh=mesh, graphdef=graphdef, params=params, step=step)
