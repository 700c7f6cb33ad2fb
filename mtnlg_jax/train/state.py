"""The train state and where each of its leaves lives on the mesh.

    state = {'params':    fp32 master weights      rule table + ZeRO-1 split over 'data'
             'opt_state': Adam moments (+ counts)   same as the parameter each belongs to
             'step':      int32                     replicated}

The forward and backward run on a compute-dtype copy of the parameters laid out by the rule
table alone (all-gathered over 'data'); see train/step.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mtnlg_jax.model import gpt
from mtnlg_jax.parallel import rules, stage_order
from mtnlg_jax.train.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Everything about the state that does not change during a run."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    logical_axes: dict  # parameter path -> logical axis names
    abstract_state: dict  # ShapeDtypeStructs of the state
    state_shardings: dict  # NamedShardings of the state (ZeRO-1 for params and moments)
    compute_shardings: dict  # NamedShardings of the compute copy of the parameters
    mesh: jax.sharding.Mesh


def make_setup(config, mesh):
    """Shapes and shardings of the train state, without allocating it."""
    device = mesh.devices.flat[0]
    abstract_model = nnx.eval_shape(lambda: gpt.create(config.model, config.train.seed, device))
    graphdef, abstract_params, logical_axes = gpt.split(abstract_model)
    optimizer = make_optimizer(config.optimizer)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)

    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = rules.zero_shardings(logical_axes, abstract_params, mesh)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = dict(params=param_shardings, opt_state=opt_shardings, step=replicated)
    abstract_state = dict(
        params=abstract_params,
        opt_state=abstract_opt_state,
        step=jax.ShapeDtypeStruct((), jnp.int32),
    )
    return TrainSetup(
        graphdef=graphdef,
        optimizer=optimizer,
        logical_axes=logical_axes,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        compute_shardings=rules.compute_shardings(logical_axes, mesh),
        mesh=mesh,
    )


def init_state(config, setup):
    """The initial state, created directly in its shards. Same values whatever the layout:
    JAX's partitionable threefry draws the same numbers however the output is split. Block
    parameters are put in the pipeline's stage-major order (a no-op without a pipeline)."""

    def init():
        _, params, _ = gpt.split(gpt.create(config.model, config.train.seed))
        params = stage_order.to_schedule_order(
            params, config.model.num_layers, config.mesh.stage, config.pipeline.repeats
        )
        return dict(
            params=params, opt_state=setup.optimizer.init(params), step=jnp.zeros((), jnp.int32)
        )

    with jax.set_mesh(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)()


def pipeline_order(config, setup, to):
    """A jitted state -> state that moves block parameters and moments between plain layer
    order (what checkpoints hold) and the pipeline's stage-major order (what a stage holds),
    `to` 'layer' or 'schedule'. The identity, with nothing moved, unless the schedule has both
    stages and repeats."""
    if config.mesh.stage == 1 or config.pipeline.repeats == 1:
        return lambda state: state
    convert = stage_order.to_layer_order if to == 'layer' else stage_order.to_schedule_order
    shape = (config.model.num_layers, config.mesh.stage, config.pipeline.repeats)
    return jax.jit(lambda state: convert(state, *shape), out_shardings=setup.state_shardings)
