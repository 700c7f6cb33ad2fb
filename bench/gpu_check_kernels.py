"""bench/gpu_check.py's attention sections: the flash kernel on the device against the fp32
reference, cuDNN and jax's own Pallas kernel, and their speed.

Every function takes its shapes, so the same code runs interpreted on a CPU with small ones
(`interpret=True`, as the tests do) and on the GPU with the real ones.
"""

import math
import statistics
import time

import jax
import jax.numpy as jnp

from mtnlg_jax.model import flash_attention

TOLERANCE = 2e-2  # bf16 inputs against the fp32 reference, relative to each leaf's max
KINDS = ('flash', 'cudnn', 'jax_pallas', 'plain')


def generation():
    """The first device's compute capability major (8: A100, 9: H100), None off a GPU."""
    capability = getattr(jax.devices()[0], 'compute_capability', None)
    return int(str(capability).split('.')[0]) if capability else None


def inputs(batch, seq, heads, head_dim, dtype=jnp.bfloat16, seed=0):
    """q, k, v, an output weight (for a loss whose gradients are not trivial) and seeds."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v, weight = (
        jax.random.normal(key, (batch, seq, heads, head_dim)).astype(dtype) for key in keys[:4]
    )
    seeds = flash_attention.head_seeds(jax.random.split(keys[4], batch), 0, heads)
    return q, k, v, weight, seeds


def attend(kind, seeds=None, rate=0.0, interpret=False, tiles=None):
    """The context function of one implementation: (q, k, v) -> (batch, seq, heads, dim)."""
    if kind == 'flash':
        gen = None if interpret else generation()
        return lambda q, k, v: flash_attention.flash_attention(
            q, k, v, seeds, rate, interpret=interpret, generation=gen, tiles=tiles
        )
    if kind == 'cudnn':
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation='cudnn'
        )
    if kind == 'jax_pallas':
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415

        return lambda q, k, v: pallas_attention.mha(
            q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=True,
            interpret=interpret,
        )  # fmt: skip
    if kind == 'plain':
        return lambda q, k, v: flash_attention.reference(q, k, v, seeds, rate)
    raise ValueError(kind)


def loss_and_grads(context, weight):
    def loss(q, k, v):
        return (context(q, k, v).astype(jnp.float32) * weight.astype(jnp.float32)).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def relative_errors(got, want):
    """max |got - want| / max |want| of each leaf (the tests' per-leaf measure)."""
    return [
        float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.maximum(jnp.abs(w).max(), 1e-30))
        for g, w in zip(got, want)
    ]


def compare(kind, shape, rate, interpret=False):
    """One row: the implementation's output and gradients against the fp32 reference with
    the kernel's dropout bits."""
    q, k, v, weight, seeds = inputs(*shape)
    full = [a.astype(jnp.float32) for a in (q, k, v)]
    reference = attend('plain', seeds, rate)
    want_out = jax.jit(reference)(*full)
    _, want_grads = loss_and_grads(reference, weight)(*full)
    context = attend(kind, seeds, rate, interpret)
    out = jax.jit(context)(q, k, v)
    _, grads = loss_and_grads(context, weight)(q, k, v)
    errors = relative_errors([out, *grads], [want_out, *want_grads])
    return dict(
        zip(('out', 'dq', 'dk', 'dv'), errors),
        agrees=max(errors) <= TOLERANCE,
    )


def attention(batch=2, seq=1024, heads=8, head_dims=(64, 128, 160), rates=(0.0, 0.1),
              kinds=('flash', 'cudnn', 'jax_pallas'), interpret=False):  # fmt: skip
    """The attention section: a row per (kind, head dim, dropout)."""
    rows = []
    for head_dim in head_dims:
        for rate in rates:
            for kind in kinds:
                row = dict(kind=kind, head_dim=head_dim, dropout=rate)
                if rate and kind != 'flash':
                    rows.append({**row, 'error': 'no dropout of ours (compared at dropout 0)'})
                    continue
                try:
                    row.update(compare(kind, (batch, seq, heads, head_dim), rate, interpret))
                except Exception as error:  # noqa: BLE001 -- an unsupported shape is a finding
                    row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
                rows.append(row)
    checked = [row for row in rows if 'agrees' in row]
    flash = [row for row in checked if row['kind'] == 'flash']
    return dict(
        flash_agrees=bool(flash) and all(row['agrees'] for row in flash),
        shape=f'batch {batch}, seq {seq}, heads {heads}, bf16 against fp32',
        tolerance=TOLERANCE,
        rows=rows,
    )


def median_ms(function, *args, repeats=10):
    """Median wall milliseconds of function(*args) after two warm-up calls."""
    jax.block_until_ready(function(*args))
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def causal_flops(batch, seq, heads, head_dim):
    """Forward FLOPs of causal attention as FlashAttention-2 counts them (half the dense
    4 b h s^2 d); forward + backward is 3.5 x (the backward 2.5 x the forward)."""
    return 4 * batch * heads * seq * seq * head_dim / 2


def speed_row(kind, shape, rate=0.0, tiles=None, interpret=False):
    q, k, v, weight, seeds = inputs(*shape)
    context = attend(kind, seeds, rate, interpret, tiles)
    forward = median_ms(jax.jit(context), q, k, v)
    both = median_ms(loss_and_grads(context, weight), q, k, v)
    flops = causal_flops(*shape)
    return dict(
        forward_ms=round(forward, 3),
        forward_tflops=round(flops / forward / 1e9, 1),
        fwd_bwd_ms=round(both, 3),
        fwd_bwd_tflops=round(3.5 * flops / both / 1e9, 1),
    )


def sweep_tiles(head_dim):
    """A few blocks and warps around the chosen ones (all powers of two)."""
    chosen = flash_attention.blocks(2048, head_dim, generation())
    variants = {chosen}
    for forward_q, forward_k in ((64, 64), (128, 64), (128, 128)):
        for warps in (4, 8):
            variants.add(chosen._replace(forward_q=forward_q, forward_k=forward_k,
                                         forward_warps=warps))  # fmt: skip
    for backward, warps in ((32, 4), (64, 4), (64, 8)):
        variants.add(chosen._replace(backward=backward, backward_warps=warps))
    return chosen, sorted(variants)


# Llama 3's sequence at its head dim: the rates the plan's attention would be priced at
# (batch 1 of 8192 is 4 x the work of 4 of 2048), ours and cuDNN's
LONG = dict(batch=1, seq=8192, head_dim=128, kinds=('flash', 'cudnn'))


def _tile_row(head_dim, tiles, chosen, batch_seq_heads):
    """One row of the tile sweep: our kernel with `tiles` at dropout 0.1."""
    row = dict(head_dim=head_dim, tiles=tiles._asdict(), chosen=tiles == chosen)
    try:
        row.update(speed_row('flash', (*batch_seq_heads, head_dim), 0.1, tiles))
    except Exception as error:  # noqa: BLE001 -- e.g. over the shared memory
        row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
    return row


def kernel_speed(batch=4, seq=2048, heads=16, head_dims=(128, 160), kinds=KINDS, rate=0.0,
                 sweep_head_dims=(160,), long=LONG, interpret=False):  # fmt: skip
    """The kernel_speed section: every kind at each head dim, ours and cuDNN's at the long
    sequence, then our blocks and warps at sweep_head_dims (128's were settled by two
    checks: the chosen within 5 % of the best)."""
    shapes = [(kind, (batch, seq, heads, head_dim)) for head_dim in head_dims for kind in kinds]
    if long:
        shapes += [(kind, (long['batch'], long['seq'], heads, long['head_dim']))
                   for kind in long['kinds']]  # fmt: skip
    rows = []
    for kind, shape in shapes:
        row = dict(kind=kind, seq=shape[1], head_dim=shape[3])
        try:
            row.update(speed_row(kind, shape, rate, None, interpret))
        except Exception as error:  # noqa: BLE001
            row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
        rows.append(row)
    sweep_rows = []
    for head_dim in sweep_head_dims:
        chosen, variants = sweep_tiles(head_dim)
        timed = {tiles: _tile_row(head_dim, tiles, chosen, (batch, seq, heads))
                 for tiles in variants}  # fmt: skip
        # a second sample of the chosen tiles and of the fastest forward and forward +
        # backward: a lead must beat the chosen tiles twice before they change
        ok = {tiles: row for tiles, row in timed.items() if 'error' not in row}
        again = {chosen} | {min(ok, key=lambda tiles: ok[tiles][key])
                            for key in ('forward_ms', 'fwd_bwd_ms') if ok}  # fmt: skip
        sweep_rows += list(timed.values()) + [
            dict(_tile_row(head_dim, tiles, chosen, (batch, seq, heads)), sample=2)
            for tiles in sorted(again)
        ]
    return dict(
        shape=f'batch {batch}, seq {seq}, heads {heads}, bf16, causal, dropout {rate}',
        flops='FlashAttention-2 convention: causal forward 2 b h s^2 d, backward 2.5 x',
        rows=rows,
        sweep_dropout_0_1=sweep_rows,
    )
