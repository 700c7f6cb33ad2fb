"""A VJP taken apart so that its residuals can wait in a buffer without its parameters.

    y, kept, layout = split_vjp(fn, params, x)    forward: kept = the VJP's residuals that are
                                                  not leaves of `params` (activations only)
    pullback = join_vjp(layout, kept, params)     backward, ticks later: the same VJP, the
                                                  caller's current copy of `params` put back

`jax.vjp` returns its pullback as a pytree whose leaves are the residuals; a parameter the
function multiplies by appears among them as itself (the same traced object), so it is found by
identity and left out of what is kept. The 1F1B engine (pipeline.py) stores `kept` per
micro-batch in flight; storing the chunk's weights with it would cost a copy of them per slot.
"""

import jax


def split_vjp(fn, params, *args):
    """(fn(params, *args), the kept residual leaves, the layout join_vjp needs)."""
    y, pullback = jax.vjp(fn, params, *args)
    leaves, treedef = jax.tree.flatten(pullback)
    position = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
    where = tuple(position.get(id(leaf)) for leaf in leaves)
    kept = [leaf for leaf, w in zip(leaves, where) if w is None]
    return y, kept, (treedef, where)


def join_vjp(layout, kept, params):
    """The pullback split_vjp took apart, with `params` (same structure) where it used them."""
    treedef, where = layout
    kept, leaves = iter(kept), jax.tree.leaves(params)
    return jax.tree.unflatten(treedef, [next(kept) if w is None else leaves[w] for w in where])


def probe_layout(forward, *args):
    """(shapes of the kept residuals, the layout join_vjp needs) of `forward(*args)`, a
    function returning split_vjp's triple, traced abstractly (nothing computed): every call
    of the same program keeps the same layout, so an engine probes it once, before its loop."""
    layouts = []

    def kept_only(*args):
        _, kept, layout = forward(*args)
        layouts.append(layout)  # static: eval_shape returns arrays only
        return kept

    shapes = jax.eval_shape(kept_only, *args)
    return shapes, layouts[0]
