"""bench/gpu_check.py's matmul sections: the MoE's grouped matmul (model/grouped_matmul.py's
Pallas kernel) and the FP8 recipes (model/fp8.py) on the device, each against a reference
and timed beside the alternatives.

    grouped_matmul   the kernel's output and both gradients against the fp32 one-hot
                     reference (every row through every expert, the chosen one kept), bf16,
                     per leaf; then forward + gradients ms and active TFLOP/s of the ways
                     bench/moe.py compares (ragged_dot, capacity-padded, blocks, grouped)
    fp8              each recipe's forward + both gradients against fp32 (RMS error relative
                     to the fp32 product, per leaf), its ms and TFLOP/s beside bf16
"""

import functools

import fp8 as fp8_bench
import jax
import jax.numpy as jnp
import moe as moe_bench
import numpy as np
from gpu_check_kernels import TOLERANCE, median_ms, relative_errors

from mtnlg_jax.model import fp8
from mtnlg_jax.plan import hlo_module


class _Shape:
    """bench/moe.py's arguments: the shape and the kernel's rows a tile (interpreted off a
    GPU, as the tests run it)."""

    def __init__(self, tokens, hidden, ffn, block=128):
        self.tokens, self.hidden, self.ffn, self.block = tokens, hidden, ffn, block
        self.on_gpu = jax.default_backend() == 'gpu'


def _moe_agreement(experts=8, top_k=2, shape=(2048, 512, 1024, 128)):
    """The kernel (bf16) against the fp32 one-hot reference, one cotangent for both."""
    args = _Shape(*shape)
    rows, weights, sizes = moe_bench.inputs(experts, top_k, args, jnp.float32)
    cotangent = jax.random.normal(jax.random.key(1), (rows.shape[0], args.ffn))

    def run(way, r, w):
        forward, _ = moe_bench.programs(way, args)
        out, pull = jax.vjp(lambda a, b: forward(a, b, sizes), r, w)
        return (out, *pull(cotangent.astype(out.dtype)))

    with jax.default_matmul_precision('highest'):
        want = jax.jit(functools.partial(run, 'one_hot'))(rows, weights)
    bf16 = [a.astype(jnp.bfloat16) for a in (rows, weights)]
    got = jax.jit(functools.partial(run, 'grouped'))(*bf16)
    errors = relative_errors(got, want)
    return dict(zip(('out', 'd_rows', 'd_weights'), errors), agrees=max(errors) <= TOLERANCE)


def grouped_matmul(shapes=((64, 8), (128, 8)), tokens=16384, hidden=2048, ffn=1536, block=128,
                   ways=('grouped', 'ragged', 'padded', 'blocks'),
                   agreement_shape=None):  # fmt: skip
    """The grouped_matmul section."""
    agreement = _moe_agreement(shape=agreement_shape or (2048, 512, 1024, block))
    args = _Shape(tokens, hidden, ffn, block)
    rows = []
    for experts, top_k in shapes:
        data = moe_bench.inputs(experts, top_k, args, jnp.bfloat16)
        active = 3 * 2 * tokens * top_k * hidden * ffn
        for way in ways:
            row = dict(experts=experts, top_k=top_k, way=way)
            try:
                compiled = jax.jit(moe_bench.programs(way, args)[1]).lower(*data).compile()
                ms = median_ms(compiled, *data)
                row.update(
                    compiled_vs_active=round(hlo_module.dot_flops(compiled.as_text()) / active, 2),
                    fwd_bwd_ms=round(ms, 3),
                    active_tflops=round(active / ms / 1e9, 1),
                )
            except Exception as error:  # noqa: BLE001 -- a way the compiler refuses is a finding
                row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
            rows.append(row)
    return dict(
        agreement=agreement,
        shape=f'{tokens} tokens, hidden {hidden} -> ffn {ffn}, bf16, tiles of {args.block} rows',
        rows=rows,
    )


# Llama 3 8B's block products on one micro-batch of 8192 tokens: (name, rows, K, N)
LLAMA3_8B_SHAPES = (
    ('qkv', 8192, 4096, 6144),
    ('attention out', 8192, 4096, 4096),
    ('mlp in', 8192, 4096, 14336),
    ('mlp out', 8192, 14336, 4096),
)


def fp8_matmuls(shapes=LLAMA3_8B_SHAPES):
    """The fp8 section's products: x (rows, K) @ w (K, N) and both gradients of each shape,
    bf16 and each FP8 recipe, against fp32 at 'highest' precision."""
    return dict(rows=[row for shape in shapes for row in _fp8_rows(*shape)])


def _fp8_rows(name, m, k, n):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k))
    w = jax.random.normal(keys[1], (k, n)) / k**0.5
    cotangent = jax.random.normal(keys[2], (m, n))
    reference = jax.jit(functools.partial(fp8_bench.step, 'fp32'))
    with jax.default_matmul_precision('highest'):
        want = [np.asarray(a) for a in reference(x, w, cotangent)]
    every = np.ones(m, bool)
    work = 3 * 2 * m * k * n
    rows = []
    for recipe in ('bf16', *fp8.RECIPES):
        row = dict(product=name, shape=f'{m} x {k} x {n}', recipe=recipe)
        try:
            program = jax.jit(
                functools.partial(fp8_bench.step, recipe.replace('bf16', 'fp32')),
                compiler_options=fp8.compiler_options(recipe),
            )
            data = [a.astype(jnp.bfloat16) for a in (x, w, cotangent)]
            got = program(*data)
            errors = fp8_bench.rms_errors([a.astype(jnp.float32) for a in got], want, every)
            ms = median_ms(program, *data)
            text = program.lower(*data).compile().as_text()
            row.update(
                zip(('out', 'dx', 'dw'), (round(e, 4) for e in errors)),
                fwd_bwd_ms=round(ms, 3),
                tflops=round(work / ms / 1e9, 1),
                flops_by_operands={
                    k: round(v / work, 2)
                    for k, v in sorted(hlo_module.matmul_flops_by_dtype(text).items())
                },
            )
        except Exception as error:  # noqa: BLE001
            row['error'] = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
        rows.append(row)
    bf16 = rows[0].get('fwd_bwd_ms')
    for row in rows[1:]:
        if bf16 and 'fwd_bwd_ms' in row:
            row['x_bf16_time'] = round(row['fwd_bwd_ms'] / bf16, 3)
    return rows
