"""Buffers: model variables the train step updates without differentiating them.

A router's load-balancing bias (moved after each step by the experts' loads) and FP8's amax
history (rolled by each step's amax values) are part of the model, but not parameters: no
gradient, no optimizer, no weight decay. A module declares one where it declares its
parameters, with its logical axes and the name of its update rule:

    self.bias = buffer(jnp.zeros((experts,)), ('expert_scores',), rule='router_bias')

    @update_rule('router_bias')
    def _(value, values, step):       # value: this buffer in plain layer order (a block's
        return value + ...            # buffer has its leading `layers` axis); values: the
                                      # step's values beside the loss (parallel/engine.py),
                                      # combined over the whole batch; step: int32

Where they go (train/state.py, train/step.py):

    state = {'params': ..., 'opt_state': ..., 'step': ...,
             'buffers': fp32, as the model declared them      only when the model has any
                        laid out by the rule table, blocks stage-major like the parameters}
    step:  the engines run on the compute copy of the parameters with the buffers beside
           them (one tree: a block reads its own like a parameter) and the gradients of the
           buffers are dropped; then every buffer goes through its rule, in layer order, and
           is kept as it was when the step is skipped (a non-finite loss or gradient norm)

Checkpoints hold them in plain layer order with the parameters, so they restore under any
layout; `checkpoint.init_from` takes them with the parameters (they are the model: a router's
bias routes at inference too).
"""

from flax import nnx

RULES = {}  # rule name -> fn(value, values, step) -> the value after the step


class Buffer(nnx.Variable):
    """A model variable outside the gradient (this module's docstring); metadata
    `logical_axes` as a parameter's, and `rule`, the name of its update rule."""


def buffer(value, logical_axes, rule):
    """A Buffer holding `value` (fp32: its rule accumulates small steps) updated by the rule
    registered under `rule`."""
    if rule not in RULES:
        raise KeyError(f'buffer update rule {rule!r} is not registered (update_rule)')
    return Buffer(value, logical_axes=tuple(logical_axes), rule=rule)


def update_rule(name):
    """Register fn(value, values, step) -> new value as the rule `name`."""

    def register(fn):
        RULES[name] = fn
        return fn

    return register


def apply_rules(buffers, rules, values, step):
    """Every buffer after the step: RULES[rule](value, values, step), leaf by leaf; buffers
    and rules are trees of the same structure (plain layer order)."""
    return _map(lambda value, rule: RULES[rule](value, values, step), buffers, rules)


def _map(fn, buffers, rules):
    """fn(leaf, rule name) over a nested dict of buffers and its twin of rule names."""
    return {
        key: _map(fn, value, rules[key]) if isinstance(value, dict) else fn(value, rules[key])
        for key, value in buffers.items()
    }


def beside(params, buffers):
    """One nested dict of the parameters and the buffers (whose leaves are not parameters'):
    what the model's pieces read, a block its own buffers like its parameters."""
    joined = dict(params)
    for key, value in buffers.items():
        joined[key] = beside(params.get(key, {}), value) if isinstance(value, dict) else value
    return joined


def without(tree, buffers):
    """`tree` (shaped as `beside`'s result, e.g. its gradients) with the buffers' leaves taken
    out: the parameters' part."""
    kept = {}
    for key, value in tree.items():
        if key not in buffers:
            kept[key] = value
        elif isinstance(buffers[key], dict):
            kept[key] = without(value, buffers[key])
    return kept
