"""Taps: each weight matmul's input and output gradient, handed out by a backward that leaves
the weights' gradient for later (ZB-H1's B and W slots, parallel/zero_bubble.py).

A block's matmul with a kernel parameter, y = einsum(spec, x, w), goes through `matmul`
(model/layers.py's project, attention's projections). Outside `tapping` it is that einsum: a
program that never taps is the one it was. Inside, on a kernel the context knows, it is
`_tapped(spec, x, w, x_tap, y_tap)`: the same y, and a VJP that returns x's gradient, none
for w, and, as the "gradients" of the two zero taps, x itself and y's gradient dy. So a VJP
of the block stack taken with its taps as inputs (the engine's B, parallel/stage.py) runs the
input-gradient chain once and hands out every site's (x, dy); W contracts them over the
tokens, dW = x^T dy per site (`weight_grads`), the only matmuls the weights' gradient needs.
Everything else keeps its gradient in B: norms and biases (elementwise reductions), and the
matmuls off the einsum path (FP8 sites, an MoE's router and routed experts, the head).

What is held from B to W is each layer's minimum of these: a site that reads the same x as an
earlier one (Q and KV, SwiGLU's in and gate) takes only its dy, and a residual-stream value
(the x of QKV and MLP-in, the dy of attention-out and MLP-out) is held as its sequence-
parallel shard and gathered again in W, as Megatron's backward gathers a layer's input again
for the weights' gradient (Site.axes): Llama 3 405B's at tensor 8, 0.50 GiB a layer from 1.87
(plan/arithmetic.py's tap_bytes, tests/test_plan_compiled.py against the compiled loop).

    sites = probe(fn, *args)        Site (kernel path, spec, x and y shapes) of every tapped
                                    call fn makes in one layer, in call order
    zeros(sites, layers)            the zero taps a stack of `layers` layers takes: per site
                                    (x, y), or (y,) where it shares an x, on a layer axis
    hold(buffers, sites)            tap buffers laid out as held (the stream's shard)
    with tapping(kernels, taps):    a layer's calls take its taps in order (the model's scan
                                    body); kernels: {id(kernel variable): its path}
    add_weight_grads(acc, sites, stashed)   acc + each kernel's dW from B's (x, dy) taps
                                            (an fp32 GEMM: the add fuses into it)
    as_read(sites)                  sites whose taps are held as the matmuls have them (a W
                                    in B's own tick: the engine's fused accumulation)
    with handed_out_as_read():      a VJP traced inside hands its taps out so (as_read's)
    subset(sites, stashed, keep)            some sites and their taps, shares re-indexed
    add_untapped(acc, grads, sites)         acc + grads but at the tapped kernels (B's add)
    untapped(grads, sites)                  grads with None at the tapped kernels
"""

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel import rules

_TAPPING = contextvars.ContextVar('mtnlg_jax_tapping', default=None)
_RECORDER = contextvars.ContextVar('mtnlg_jax_tap_recorder', default=None)
_AS_READ = contextvars.ContextVar('mtnlg_jax_taps_as_read', default=False)


class Site(NamedTuple):
    """A tapped matmul of one layer: the kernel's path in the block's parameters, the einsum's
    spec, its input x and output y (jax.ShapeDtypeStruct, no layer axis); shares: the index
    of an earlier site of the layer with the same input (QKV's Q and KV, the MLP's in and
    gate), whose x tap serves both, else None; axes: x's and y's logical axes as held from B
    to W (`_axes`): a residual-stream value (batch, seq, embed) as its sequence-parallel
    shard, gathered again in W, as Megatron gathers a layer's input again for the weights'
    gradient; every other as the matmul reads or writes it (heads, mlp split over tensor)."""

    path: tuple
    spec: str
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct
    shares: int = None
    axes: tuple = (None, None)

    def held(self):
        """The logical axes of each of arrays() as held from B to W."""
        return self.axes[-len(self.arrays()) :]

    def arrays(self):
        """What the site's taps hold: (x, y), or (y,) where it shares an earlier site's x."""
        return (self.y,) if self.shares is not None else (self.x, self.y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tapped(spec, layout, x, w, x_tap, y_tap):
    del x_tap, y_tap  # zeros (x_tap None where an earlier site's serves): only cotangents matter
    return jnp.einsum(spec, x, w)


def _tapped_fwd(spec, layout, x, w, x_tap, y_tap):
    return jnp.einsum(spec, x, w), (x, w)


def _tapped_bwd(spec, layout, residuals, dy):
    """(x's gradient, no gradient for w, x and dy through the taps): the weight's gradient
    is left to whoever reads the taps, each tap laid out as held. layout: (x's and y's
    logical axes as held, whether x_tap is None)."""
    (axes, shared), (x, w) = layout, residuals
    _, pullback = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)
    x_tap, y_tap = map(rules.constrain, (x, dy), axes)
    return pullback(dy)[0], None, None if shared else x_tap, y_tap


_tapped.defvjp(_tapped_fwd, _tapped_bwd)


def _axes(kernel, spec):
    """The logical axes of x and y of `spec` with a kernel of these logical axes: the
    kernel's names where they share a letter, then batch and seq; a residual-stream
    value (three dimensions, the last the kernel's embed: QKV's and MLP-in's x, attention-
    out's and MLP-out's y) with its sequence as the stream's (split under sequence
    parallelism), else the sequence whole (the matmul's)."""
    inputs, out = spec.split('->')
    x_spec, w_spec = inputs.split(',')
    names = getattr(kernel, 'logical_axes', ())  # a stacked kernel's: 'layers' ahead
    names = dict(zip(w_spec, names[len(names) - len(w_spec) :]))

    def of(letters):
        stream = len(letters) == 3 and names.get(letters[-1]) == 'embed'
        seq = 'residual_seq' if stream else 'seq'
        return tuple(names.get(c, 'batch' if i == 0 else seq) for i, c in enumerate(letters))

    return of(x_spec), of(out)


class _Layer:
    """One layer's tapping while the model traces it: which kernels are tapped, the taps left
    to hand out, and the recorder (probe) that notes each tapped call."""

    def __init__(self, kernels, layer_taps, recorder):
        self.kernels, self.taps, self.recorder = kernels, list(layer_taps), recorder
        self.inputs = []  # while probing: each recorded site's x, to find a shared one
        if recorder is not None:
            recorder.clear()  # the sites of the layer traced last: a body traced twice is one

    def matmul(self, kernel, spec, x, w):
        path = self.kernels.get(id(kernel))
        if path is not None and self.taps:
            x_tap, y_tap = (None, *self.taps.pop(0))[-2:]  # (y,): x is an earlier site's
            axes = _axes(kernel, spec)
            axes = tuple(map(_read, axes)) if _AS_READ.get() else axes
            return _tapped(spec, (axes, x_tap is None), x, w, x_tap, y_tap)
        y = jnp.einsum(spec, x, w)
        if path is not None and self.recorder is not None:  # probing: no taps given
            shares = next((i for i, seen in enumerate(self.inputs) if seen is x), None)
            self.inputs.append(x)
            shapes = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y))
            self.recorder.append(Site(path, spec, *shapes, shares, _axes(kernel, spec)))
        return y


def matmul(kernel, spec, x, w):
    """einsum(spec, x, w), w the value of the parameter `kernel` (its variable): tapped inside
    `tapping` when the layer knows the kernel, the plain einsum everywhere else."""
    layer = _TAPPING.get()
    if layer is None:
        return jnp.einsum(spec, x, w)
    return layer.matmul(kernel, spec, x, w)


@contextlib.contextmanager
def tapping(kernels, layer_taps):
    """While one layer runs: its tapped calls take layer_taps [(x_tap, y_tap)] in order
    (empty while probing); kernels: {id(kernel variable): path}."""
    layer = _Layer(kernels, layer_taps, _RECORDER.get())
    token = _TAPPING.set(layer)
    try:
        yield
    finally:
        _TAPPING.reset(token)
    assert not layer.taps, 'a layer took fewer taps than it was given'


@contextlib.contextmanager
def handed_out_as_read(on=True):
    """While a VJP with taps is traced (its forward): the taps leave its backward as the
    matmuls read them (a stream value gathered, where the backward's GEMMs hide the gather)
    instead of as held (its shard, gathered again in W): for a W in B's own tick, the engine's
    fused accumulation (as_read's sites)."""
    token = _AS_READ.set(on)
    try:
        yield
    finally:
        _AS_READ.reset(token)


def probe(fn, *args):
    """The Sites of one layer of fn(*args), a function that runs a block stack with empty taps,
    traced abstractly (nothing computed)."""
    sites = []
    token = _RECORDER.set(sites)
    try:
        jax.eval_shape(fn, *args)
    finally:
        _RECORDER.reset(token)
    return tuple(sites)


def zeros(sites, layers):
    """The zero taps of a stack of `layers` layers: site.arrays() per site, stacked."""
    return [tuple(jnp.zeros((layers, *a.shape), a.dtype) for a in site.arrays()) for site in sites]


def hold(buffers, sites):
    """Tap buffers [site.arrays() per site, behind leading slot and layer axes] laid out as
    each site holds its taps (Site.axes): the sequence shard of a residual-stream value."""
    return [tuple(map(rules.constrain, b, site.held())) for b, site in zip(buffers, sites)]


def weight_grads(sites, stashed, acc=None):
    """{kernel path: dW (layers, ...), fp32}: per site x and dy contracted over every axis but
    the kernel's, summed over the calls of a kernel (sequence pieces); stashed: the taps as
    zeros(sites, ...) lays them out. A stream tap is gathered over the sequence first. acc:
    {kernel path: fp32 accumulator} the sums start from (each GEMM's output added to it
    directly: XLA:GPU fuses that add into the GEMM), or None."""
    grads = dict(acc or {})
    for site, taps in zip(sites, stashed):
        x = taps[0] if site.shares is None else stashed[site.shares][0]
        x, dy = map(rules.constrain, (x, taps[-1]), map(_read, site.axes))  # a stream tap
        inputs, out = site.spec.split('->')  # gathered again
        x_spec, w_spec = inputs.split(',')
        layer = next(c for c in 'lzyxw' if c not in site.spec)
        d = _contract(f'{layer}{x_spec}', x, f'{layer}{out}', dy, f'{layer}{w_spec}')
        grads[site.path] = d if site.path not in grads else grads[site.path] + d
    return grads


def _contract(x_spec, x, dy_spec, dy, w_spec):
    """dW in fp32: x and dy contracted over every axis but w_spec's, the operand that holds
    more of the kernel's axes (attention-out's x: heads and head_dim) as the GEMM's right-hand
    side. XLA:GPU's GEMM fusion takes a left-hand side whose kernel axes arrive transposed (the
    flash kernel's output, heads outermost) into the GEMM, and then a row tile must divide
    head_dim: H100's untuned 64 rows do not divide MT-NLG's 160 ("Couldn't find output tile
    sizes"); a right-hand side like that it writes contiguous first (docs/benchmarks.md, "The
    530 B's dW GEMMs on H100s")."""
    layer = w_spec[0]  # the GEMM's batch axis, leading every spec

    def kept(spec):
        return ''.join(c for c in spec[1:] if c in w_spec)

    if len(kept(x_spec)) > len(kept(dy_spec)):
        x_spec, x, dy_spec, dy = dy_spec, dy, x_spec, x
    # in the GEMM's own order, then transposed (jnp.einsum would swap the operands back)
    order = layer + kept(x_spec) + kept(dy_spec)
    d = jnp.einsum(f'{x_spec},{dy_spec}->{order}', x, dy, preferred_element_type=jnp.float32)
    return jnp.transpose(d, [order.index(c) for c in w_spec])


def add_weight_grads(acc, sites, stashed):
    """acc (fp32, the chunk's tree) plus each tapped kernel's gradient (weight_grads)."""
    leaves = {_keys(path): a for path, a in jax.tree_util.tree_leaves_with_path(acc)}
    tapped = {site.path for site in sites}
    grads = weight_grads(sites, stashed, {k: a for k, a in leaves.items() if k in tapped})
    return jax.tree_util.tree_map_with_path(lambda path, a: grads.get(_keys(path), a), acc)


def subset(sites, stashed, keep):
    """(the sites at indices `keep`, their taps): a site's shares re-indexed into the subset,
    which holds every site whose x a kept one shares."""
    index = {i: j for j, i in enumerate(keep)}
    chosen = tuple(
        sites[i]._replace(shares=None if sites[i].shares is None else index[sites[i].shares])
        for i in keep
    )
    return chosen, [stashed[i] for i in keep]


def _read(axes):
    """Logical axes as the matmul reads or writes them: a stream value's sequence whole."""
    return tuple(a.replace('residual_seq', 'seq') for a in axes)


def as_read(sites):
    """The sites with their taps held as the matmuls read and write them (a stream value
    gathered): for a W in B's own tick, where B has them so, nothing to gather again."""
    return tuple(site._replace(axes=tuple(map(_read, site.axes))) for site in sites)


def add_untapped(acc, grads, sites):
    """acc + grads in fp32 at every leaf but the tapped kernels' (their gradient is W's;
    grads may hold None there, as `untapped` leaves it)."""
    tapped = {site.path for site in sites}

    def add(path, a, g):
        return a if _keys(path) in tapped else a + g.astype(jnp.float32)

    return jax.tree_util.tree_map_with_path(add, acc, grads)


def untapped(grads, sites):
    """grads with None at the tapped kernels: what a conditional hands out of B where W
    computes those (no zeros of the kernels' size)."""
    tapped = {site.path for site in sites}
    return jax.tree_util.tree_map_with_path(
        lambda path, g: None if _keys(path) in tapped else g, grads
    )


def _keys(path):
    return tuple(getattr(k, 'key', getattr(k, 'name', k)) for k in path)
