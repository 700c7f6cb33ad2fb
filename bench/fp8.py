"""FP8 matmuls by recipe: their error against fp32 on the CPU, and what XLA:GPU compiles.

    python bench/fp8.py [--rows 4096] [--hidden 1024] [--ffn 2048] [--gpu]

Each recipe of model/fp8.py multiplies x (rows, hidden) by w (hidden, ffn) and takes both
gradients (a random cotangent). Columns: the RMS error relative to the fp32 product, of the
output, x's gradient and w's gradient, on normal inputs and on inputs with one outlier of 1e6
in x (the rows without it); with --gpu (needs `make gpu-compile`), the matmul FLOPs of the
H100 compile by operand types (plan/hlo_module.py's matmul_flops_by_dtype), as shares of the
three products' work.
"""

import argparse
import functools
import sys

GPU = '--gpu' in sys.argv
if GPU:
    from mtnlg_jax.xla import gpu_compile  # noqa: E402

    gpu_compile.enable()
    gpu_compile.prepare_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import compile_for_one_h100, print_table  # noqa: E402
from mtnlg_jax.model import fp8  # noqa: E402
from mtnlg_jax.plan import hlo_module  # noqa: E402


def step(recipe, x, w, cotangent):
    scales = None
    if recipe == 'delayed':  # as if the history's amax were this step's
        scales = fp8.scale_of(fp8.amax(x), fp8.E4M3), fp8.scale_of(fp8.amax(w), fp8.E4M3)
    if recipe == 'fp32':
        out, pull = jax.vjp(jnp.matmul, x, w)
    else:
        out, pull = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe, scales), x, w)
    return (out, *pull(cotangent))


def rms_errors(got, want, rows):
    return [
        float(np.sqrt(((np.asarray(g)[rows] - e[rows]) ** 2).mean() / (e[rows] ** 2).mean()))
        if g.shape[0] == rows.shape[0]
        else float(np.sqrt(((np.asarray(g) - e) ** 2).mean() / (e**2).mean()))
        for g, e in zip(got, want)
    ]


def cpu_rows(args):
    key_x, key_w, key_c = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (args.rows, args.hidden))
    w = jax.random.normal(key_w, (args.hidden, args.ffn)) / args.hidden**0.5
    cotangent = jax.random.normal(key_c, (args.rows, args.ffn))
    outlier = x.at[3, 5].set(1e6)
    others = np.arange(args.rows) != 3
    rows = []
    for recipe in fp8.RECIPES:
        cells = [recipe]
        for inputs in (x, outlier):
            want = [
                np.asarray(a) for a in jax.jit(step, static_argnums=0)('fp32', inputs, w, cotangent)
            ]
            got = jax.jit(step, static_argnums=0)(recipe, inputs, w, cotangent)
            cells += [f'{e:.3f}' for e in rms_errors(got, want, others)]
        rows.append(cells)
    return rows


def gpu_rows(args):
    shapes = [(args.rows, args.hidden), (args.hidden, args.ffn), (args.rows, args.ffn)]
    work = 3 * 2 * args.rows * args.hidden * args.ffn
    rows = []
    for recipe in ('fp32', *fp8.RECIPES):
        program = functools.partial(step, recipe)
        options = fp8.compiler_options(recipe)
        compiled = compile_for_one_h100(program, [(s, jnp.bfloat16) for s in shapes], options)
        by_dtype = hlo_module.matmul_flops_by_dtype(compiled.as_text())
        shares = ', '.join(f'{k} {v / work:.2f}' for k, v in sorted(by_dtype.items()))
        rows.append(['bf16' if recipe == 'fp32' else recipe, shares])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rows', type=int, default=4096)
    parser.add_argument('--hidden', type=int, default=1024)
    parser.add_argument('--ffn', type=int, default=2048)
    parser.add_argument('--gpu', action='store_true', help='also compile for one H100')
    args = parser.parse_args()
    shape = f'x ({args.rows}, {args.hidden}) @ w ({args.hidden}, {args.ffn})'
    print_table(
        f'FP8 against fp32 on the CPU ({shape}; RMS error relative to fp32)',
        ['recipe', 'out', 'dx', 'dw', 'out, outlier', 'dx, outlier', 'dw, outlier'],
        cpu_rows(args),
    )
    if args.gpu:
        print_table(
            f'Compiled for one H100 ({shape}, bf16 in; matmul FLOPs by operand types, as a '
            'share of the forward and both gradients)',
            ['recipe', 'FLOPs by operand types'],
            gpu_rows(args),
        )


if __name__ == '__main__':
    main()
