"""An MoE layer's grouped matmul, four ways, as the compilers build them: FLOPs against the
active work, bytes, and speed on the CPU.

    python bench/moe.py [--tokens 4096] [--hidden 512] [--ffn 512] [--block 32] [--gpu]

Every token goes to top_k of `experts` experts (uniformly random choices, fixed seed); its
rows are sorted by expert, and one projection (hidden -> ffn) of every expert multiplies
them, forward and with its gradients (x and the expert weights). The active work is
2 x tokens x top_k x hidden x ffn per matmul (x 3 with the gradients). Ways:

    ragged      jax.lax.ragged_dot(rows, weights, group sizes): dropless
    padded      capacity-padded: each expert's rows in C = capacity x rows / experts slots,
                what overflows dropped, one batched matmul (experts, C, hidden)
    blocks      dropless in blocks of --block rows: each expert's rows padded to whole
                blocks, a scan over blocks each multiplying its expert's weights (megablocks'
                layout without a kernel of its own)
    grouped     model/grouped_matmul.py: the rows in tiles of --block, each tile one expert's,
                a Pallas kernel reading each tile's expert weights in place (Triton on the
                GPU; interpreted on the CPU, where its time says nothing)
    one_hot     the dense reference: every row through every expert, the k chosen kept

Columns: compiled / active matmul FLOPs (plan/hlo_module.py's counter over the optimized HLO:
every dot and GEMM call times its loop trips), the bytes its kernels read and write in device
memory (plan/overlap.py's hbm_bytes: each kernel's operands and result as the replay prices
them, loops by their trips), and on the CPU rows/s of the forward and of forward + gradients
(median of 3 after a warm-up; a way whose compiled work exceeds --max_gflop is compiled
only). With --gpu (needs `make gpu-compile`), the same compiled for one H100 (compile-only:
no time), with the compile's temporary bytes beside (what the program allocates besides its
inputs and outputs).
"""

import argparse
import statistics
import sys
import time

GPU = '--gpu' in sys.argv
if GPU:
    from mtnlg_jax.xla import gpu_compile  # noqa: E402

    gpu_compile.enable()
    gpu_compile.prepare_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import compile_for_one_h100, print_table  # noqa: E402
from mtnlg_jax.model import grouped_matmul  # noqa: E402
from mtnlg_jax.plan import hlo_module, overlap  # noqa: E402

SHAPES = ((8, 2), (128, 8))  # (experts, top_k): Mixtral's, Qwen3-MoE's


def ragged(rows, weights, sizes, args):
    return jax.lax.ragged_dot(rows, weights, sizes)


def padded(rows, weights, sizes, args, capacity=1.0):
    experts = weights.shape[0]
    slots = int(np.ceil(capacity * rows.shape[0] / experts))
    expert, position = _expert_and_position(sizes, rows.shape[0])
    kept = position < slots
    index = jnp.where(kept, expert * slots + position, experts * slots)  # dropped: off the end
    buffer = jnp.zeros((experts * slots, rows.shape[1]), rows.dtype)
    buffer = buffer.at[index].set(rows, mode='drop')
    out = jnp.einsum('eck,ekn->ecn', buffer.reshape(experts, slots, -1), weights)
    out = out.reshape(experts * slots, -1)
    return jnp.where(kept[:, None], out[jnp.minimum(index, experts * slots - 1)], 0)


def blocks(rows, weights, sizes, args):
    experts, block = weights.shape[0], args.block
    count = -(-rows.shape[0] // block) + experts  # whole blocks of every expert, at most
    expert, position = _expert_and_position(sizes, rows.shape[0])
    padded_sizes = -(-sizes // block) * block
    starts = jnp.cumsum(padded_sizes) - padded_sizes
    index = starts[expert] + position
    buffer = jnp.zeros((count * block, rows.shape[1]), rows.dtype).at[index].set(rows)
    block_expert = jnp.searchsorted(jnp.cumsum(padded_sizes), jnp.arange(count) * block, 'right')
    block_expert = jnp.minimum(block_expert, experts - 1)

    def one_block(_, xs):
        x, e = xs
        return None, x @ jax.lax.dynamic_index_in_dim(weights, e, 0, keepdims=False)

    _, out = jax.lax.scan(one_block, None, (buffer.reshape(count, block, -1), block_expert))
    return out.reshape(count * block, -1)[index]


def grouped(rows, weights, sizes, args):
    layout = grouped_matmul.tile_layout(sizes, rows.shape[0], args.block)
    tiled = grouped_matmul.to_tiles(rows, layout)
    out = grouped_matmul.grouped_matmul(tiled, weights, layout, interpret=not args.on_gpu)
    return grouped_matmul.from_tiles(out, layout)


def one_hot(rows, weights, sizes, args):
    expert, _ = _expert_and_position(sizes, rows.shape[0])
    every = jnp.einsum('mk,ekn->men', rows, weights)
    return jnp.take_along_axis(every, expert[:, None, None], axis=1)[:, 0]


def _expert_and_position(sizes, count):
    """Each sorted row's expert and its position among that expert's rows."""
    ends = jnp.cumsum(sizes)
    expert = jnp.searchsorted(ends, jnp.arange(count), 'right')
    return expert, jnp.arange(count) - (ends - sizes)[expert]


WAYS = {
    'ragged': ragged, 'padded': padded, 'blocks': blocks, 'grouped': grouped, 'one_hot': one_hot,
}  # fmt: skip


def inputs(experts, top_k, args, dtype):
    """(sorted rows, expert weights, group sizes) of random routing."""
    key_x, key_w, key_r = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (args.tokens, args.hidden), dtype)
    w = jax.random.normal(key_w, (experts, args.hidden, args.ffn), dtype) / args.hidden**0.5
    scores = jax.random.uniform(key_r, (args.tokens, experts))
    chosen = jax.lax.top_k(scores, top_k)[1].reshape(-1)
    order = jnp.argsort(chosen, stable=True)
    sizes = jnp.bincount(chosen, length=experts).astype(jnp.int32)
    return x[order // top_k], w, sizes


def programs(way, args):
    """(forward, forward + gradients of x and the weights) of one way."""
    fn = WAYS[way]

    def forward(rows, weights, sizes):
        return fn(rows, weights, sizes, args)

    def with_grads(rows, weights, sizes):
        # a cotangent of ones would let XLA turn the weights' gradient into a sum of rows
        # (the output too: a linear map's gradients need none of it, and XLA would drop it)
        out, pullback = jax.vjp(lambda r, w: forward(r, w, sizes), rows, weights)
        cotangent = jax.random.normal(jax.random.key(1), (rows.shape[0], args.ffn), rows.dtype)
        return out, pullback(cotangent)

    return forward, with_grads


def measure(compiled, active):
    """(compiled / active FLOPs, MiB moved in device memory, MiB of temporaries)."""
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    temp = getattr(memory, 'temp_size_in_bytes', 0) if memory is not None else 0
    return hlo_module.dot_flops(text) / active, overlap.hbm_bytes(text) / 2**20, temp / 2**20


def timed(compiled, args_):
    jax.block_until_ready(compiled(*args_))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args_))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_rows(args):
    rows = []
    for experts, top_k in SHAPES:
        data = inputs(experts, top_k, args, jnp.float32)
        active = 2 * args.tokens * top_k * args.hidden * args.ffn
        for way in WAYS:
            cells = [f'{experts} x top {top_k}', way]
            for program, work in zip(programs(way, args), (active, 3 * active)):
                compiled = jax.jit(program).lower(*data).compile()
                ratio, moved, _ = measure(compiled, work)
                moved, speed = f'{moved:.1f}', '(not run)'
                if way == 'grouped':  # the interpreter's loops: neither says anything
                    moved = speed = '(interpreted)'
                elif ratio * work <= args.max_gflop * 1e9:
                    speed = f'{args.tokens * top_k / timed(compiled, data):,.0f}'
                cells += [f'{ratio:.2f}', moved, speed]
            rows.append(cells)
    return rows


def gpu_rows(args):
    args.on_gpu = True
    rows = []
    for experts, top_k in SHAPES:
        shapes = [(a.shape, a.dtype) for a in inputs(experts, top_k, args, jnp.bfloat16)]
        active = 2 * args.tokens * top_k * args.hidden * args.ffn
        for way in WAYS:
            cells = [f'{experts} x top {top_k}', way]
            for program, work in zip(programs(way, args), (active, 3 * active)):
                ratio, moved, temp = measure(compile_for_one_h100(program, shapes), work)
                cells += [f'{ratio:.2f}', f'{moved:.1f}', f'{temp:.1f}']
            rows.append(cells)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--tokens', type=int, default=4096)
    parser.add_argument('--hidden', type=int, default=512)
    parser.add_argument('--ffn', type=int, default=512)
    parser.add_argument('--block', type=int, default=32, help='rows a block (blocks)')
    parser.add_argument('--max_gflop', type=float, default=100.0, help='run no larger on CPU')
    parser.add_argument('--gpu', action='store_true', help='also compile for one H100')
    args = parser.parse_args()
    args.on_gpu = False
    shape = f'{args.tokens} tokens, hidden {args.hidden} -> ffn {args.ffn}'
    print_table(
        f'The grouped matmul on the CPU ({shape}, fp32; rows/s: tokens x top_k a second)',
        ['experts', 'way', 'fwd FLOPs / active', 'fwd MiB moved', 'fwd rows/s',
         'fwd+grad FLOPs / active', 'fwd+grad MiB moved', 'fwd+grad rows/s'],
        cpu_rows(args),
    )  # fmt: skip
    if args.gpu:
        print_table(
            f'The grouped matmul compiled for one H100 ({shape}, bf16; compile only)',
            ['experts', 'way', 'fwd FLOPs / active', 'fwd MiB moved', 'fwd temp MiB',
             'fwd+grad FLOPs / active', 'fwd+grad MiB moved', 'fwd+grad temp MiB'],
            gpu_rows(args),
        )  # fmt: skip


if __name__ == '__main__':
    main()
