"""A trained model out of a workdir, on whatever mesh the evaluation or generation asks for.

A workdir holds config.json (the resolved config of its run) and orbax checkpoints that
restore onto any layout. Inference picks its own layout (data x tensor, stage 1: the blocks
are not pipelined for inference) and keeps the checkpoint's padded vocabulary, which depends
on the tensor size of the run that wrote it (a multiple of 128 x tensor always divides over
any tensor size up to 128).
"""

import dataclasses
import json
import math
import os

import jax
import ml_collections
from flax import nnx

from mtnlg_jax import checkpoint as checkpoint_lib
from mtnlg_jax import config as config_lib
from mtnlg_jax.parallel.mesh import make_mesh
from mtnlg_jax.train import state as state_lib
from mtnlg_jax.train import step as step_lib


class WorkdirError(ValueError):
    """A workdir without a config or checkpoint, or a step it does not have."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ml_collections.ConfigDict  # the run's config, with the inference mesh
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: dict  # compute-dtype parameters laid out by the rule table
    step: int


def inference_config(saved, data=None, tensor=None):
    """The resolved config of a run (a dict, as in config.json), re-resolved for an inference
    mesh of data x tensor devices (defaults: the run's own); ConfigError if it cannot work."""
    config = ml_collections.ConfigDict(saved)
    data = config.mesh.data if data is None else data
    tensor = config.mesh.tensor if tensor is None else tensor
    config.mesh.update(dict(data=data, stage=1, tensor=tensor))
    config.pipeline.repeats = 1  # checkpoints hold the blocks in layer order: no schedule
    # Training batch keys only need to be consistent with the new mesh; inference ignores them
    # (and a batch-size ramp-up with them).
    config.train.update(dict(global_batch=data, micro_batch=1))
    config.train.rampup.start = 0
    num_devices = data * tensor if data > 0 and tensor > 0 else jax.device_count()
    padded_vocab = saved['model']['padded_vocab']
    config = config_lib.resolve(config, num_devices)
    config.model.padded_vocab = padded_vocab or config.model.padded_vocab
    return config


def open_tokenizer(path, model_cfg):
    """The run's sentencepiece tokenizer, checked to match the model's vocabulary (ids the
    model produces must decode, ids the tokenizer produces must embed)."""
    from mtnlg_jax.data.tokenizer import Tokenizer

    if not os.path.isfile(path):
        raise WorkdirError(f'tokenizer {path} not found (--tokenizer PATH)')
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise WorkdirError(
            f'tokenizer {path} has {tokenizer.vocab_size} pieces, but the model\'s '
            f'vocabulary is {model_cfg.vocab_size}'
        )
    return tokenizer


def read_saved_config(workdir):
    path = os.path.join(workdir, 'config.json')
    if not os.path.isfile(path):
        raise WorkdirError(f'{path} not found: --workdir must be a run of launch/train.py')
    with open(path) as f:
        return json.load(f)


def load(workdir, step=None, data=None, tensor=None, dtype=None):
    """The model of `workdir` at `step` (default: its newest checkpoint) on a data x tensor
    mesh of the first devices. dtype: compute dtype (default: the run's)."""
    config = inference_config(read_saved_config(workdir), data, tensor)
    if dtype is not None:
        config.model.compute_dtype = dtype
    if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
        raise WorkdirError(f'{workdir} has no checkpoints/')
    checkpoints = checkpoint_lib.Checkpoints(workdir)
    steps = checkpoints.all_steps()
    if not steps or (step is not None and step not in steps):
        raise WorkdirError(
            f'{workdir}: no checkpoint of step {step}; it has {sorted(steps) or "none"}'
        )
    step = max(steps) if step is None else step
    shape = (config.mesh.data, config.mesh.stage, config.mesh.tensor)
    mesh = make_mesh(*shape, devices=jax.devices()[: math.prod(shape)])
    setup = state_lib.make_setup(config, mesh)
    with jax.set_mesh(mesh):
        abstract = checkpoint_lib.abstract_with_shardings(
            setup.abstract_state, setup.state_shardings
        )
        state, _ = checkpoints.restore(abstract, step)
        checkpoints.close()
        to_compute = jax.jit(
            lambda p: step_lib.compute_copy(config, setup, p),
            out_shardings=setup.compute_shardings,
        )
        params = to_compute(state['params'])
    return LoadedModel(config=config, mesh=mesh, graphdef=setup.graphdef, params=params, step=step)
