"""The train state and where each of its leaves lives on the mesh.

    state = {'params':    fp32 master weights      rule table + ZeRO-1 split over 'data'
             'opt_state': Adam moments (+ counts)   same as the parameter each belongs to
             'step':      int32                     replicated
             'buffers':   fp32, outside the         rule table (no ZeRO: they are small);
                          gradient                  only for a model that has any
                                                    (model/buffers.py)}

The forward and backward run on a compute-dtype copy of the parameters laid out by the rule
table alone (all-gathered over 'data'); see train/step.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
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
    stage_layers: stage_order.StageLayers  # where each layer's blocks are stored
    # The state in plain layer order, the model's layers only (what checkpoints hold and
    # parameters are counted on): the same as the above unless stages of unequal depth pad
    # the stored block stack (parallel/stage_order.py).
    layer_abstract_state: dict
    layer_state_shardings: dict
    # The model's buffers (model/buffers.py): their logical axes and update rules' names,
    # trees like state['buffers'] ({} for a model without any).
    buffer_axes: dict = dataclasses.field(default_factory=dict)
    buffer_rules: dict = dataclasses.field(default_factory=dict)


def make_setup(config, mesh):
    """Shapes and shardings of the train state, without allocating it."""
    device = mesh.devices.flat[0]
    abstract_model = nnx.eval_shape(lambda: gpt.create(config.model, config.train.seed, device))
    graphdef, layer_params, logical_axes = gpt.split(abstract_model)
    layer_buffers, buffer_axes, buffer_rules = gpt.buffers(abstract_model)
    layers = stage_order.of_config(config)
    optimizer = make_optimizer(config.optimizer)
    abstract_params, abstract_buffers = layer_params, layer_buffers
    if layers.padded:
        abstract_params, abstract_buffers = jax.eval_shape(
            lambda t: stage_order.to_schedule_order(t, layers), (layer_params, layer_buffers)
        )
    abstract_state, state_shardings = _sharded_state(
        optimizer,
        (abstract_params, rules.zero_shardings(logical_axes, abstract_params, mesh)),
        (abstract_buffers, rules.compute_shardings(buffer_axes, mesh)),
        mesh,
    )
    layer_state, layer_shardings = abstract_state, state_shardings
    if layers.padded:
        layer_state, layer_shardings = _sharded_state(
            optimizer,
            (layer_params, rules.layer_order_shardings(logical_axes, layer_params, mesh)),
            (layer_buffers, rules.layer_order_shardings(buffer_axes, layer_buffers, mesh)),
            mesh,
        )
    return TrainSetup(
        graphdef=graphdef,
        optimizer=optimizer,
        logical_axes=logical_axes,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        compute_shardings=rules.compute_shardings(logical_axes, mesh),
        mesh=mesh,
        stage_layers=layers,
        layer_abstract_state=layer_state,
        layer_state_shardings=layer_shardings,
        buffer_axes=buffer_axes,
        buffer_rules=buffer_rules,
    )


def _sharded_state(optimizer, params, buffers, mesh):
    """(abstract state, its shardings) of parameters and buffers, each an (abstract tree, its
    shardings) pair: the Adam moments as their parameter, the step replicated; no 'buffers'
    entry for a model without any."""
    abstract_params, param_shardings = params
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    shardings = dict(params=param_shardings, opt_state=opt_shardings, step=replicated)
    abstract_state = dict(
        params=abstract_params,
        opt_state=abstract_opt_state,
        step=jax.ShapeDtypeStruct((), jnp.int32),
    )
    if buffers[0]:
        abstract_state['buffers'], shardings['buffers'] = buffers
    return abstract_state, shardings


def init_state(config, setup):
    """The initial state, created directly in its shards. Same values whatever the layout:
    JAX's partitionable threefry draws the same numbers however the output is split. Block
    parameters (and buffers) are put in the pipeline's stage-major order (a no-op without a
    pipeline)."""

    def init():
        model = gpt.create(config.model, config.train.seed)
        _, params, _ = gpt.split(model)
        params = stage_order.to_schedule_order(params, setup.stage_layers)
        state = dict(
            params=params, opt_state=setup.optimizer.init(params), step=jnp.zeros((), jnp.int32)
        )
        if setup.buffer_rules:
            buffers = gpt.buffers(model)[0]
            state['buffers'] = stage_order.to_schedule_order(buffers, setup.stage_layers)
        return state

    with jax.set_mesh(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)()


def pipeline_order(config, setup, to):
    """A jitted state -> state that moves block parameters and moments between plain layer
    order (what checkpoints hold, laid out as setup.layer_state_shardings) and the pipeline's
    stage-major order (what a stage holds), `to` 'layer' or 'schedule'. The identity, with
    nothing moved, when the two orders agree (no stages, or one chunk a stage of equal
    depth)."""
    layers = setup.stage_layers
    held = layers.storage()
    if np.array_equal(held, np.arange(len(held))):
        return lambda state: state
    if to == 'layer':
        convert, out = stage_order.to_layer_order, setup.layer_state_shardings
    else:
        convert, out = stage_order.to_schedule_order, setup.state_shardings
    return jax.jit(lambda state: convert(state, layers), out_shardings=out)
