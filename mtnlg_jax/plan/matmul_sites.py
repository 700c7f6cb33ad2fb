"""Which matmuls of an FP8 step stayed in the compute dtype, and why: the compiled step's
matmul FLOPs that are not FP8 x FP8 products, by what they multiply.

    output layer     a dot with a vocabulary-wide dimension (the logits, their gradients)
    attention        a fused attention kernel, or a dot of the plain path's scores (its
                     einsums' (queries, keys) subscripts in the op name: model/attention.py)
    router           an fp32 dot with an experts-wide dimension
    routed experts   the grouped matmul's kernels (model/grouped_matmul.py)
    block            the rest: block products (blockwise's by design; under tensorwise or
                     delayed, one the GEMM rewriter did not take: read the HLO)

Sites are told apart by kernel names, shapes and einsum subscripts: the compiled ops' names
carry jax's einsums and scopes, not the model's modules.
"""

import collections
import re

from mtnlg_jax.model import grouped_matmul
from mtnlg_jax.plan import hlo_module

REASONS = {
    'output layer': 'the head stays in the compute dtype in every recipe (the logits)',
    'attention': 'the attention kernels multiply the compute dtype',
    'router': 'fp32 by design (the choice of experts)',
    'routed experts': 'the grouped kernel multiplies FP8 values at the compute dtype rate',
    'block': 'block products the GEMM rewriter did not take into FP8 (read the HLO)',
}
SCORES = re.compile(r'bhqk|bkgqs')  # the plain path's score subscripts (model/attention.py)
BLOCKWISE = 'blockwise: no GEMM with per-tile scales on Hopper, one of the values scaled back'


def reason(site, recipe):
    """Why `site`'s matmuls are in the compute dtype under model.fp8 = `recipe`."""
    return BLOCKWISE if (site, recipe) == ('block', 'blockwise') else REASONS[site]


def stayed(hlo_text, model, tensor, branch_weights=None):
    """{site: FLOPs a step} of the matmuls that are not FP8 x FP8 (hlo_module.is_fp8), for a
    model config (its padded_vocab, moe.experts) with the vocabulary over `tensor`."""
    vocab = {model.padded_vocab, model.padded_vocab // tensor}
    experts = model.get('moe', {}).get('experts', 0)
    by_site = collections.Counter()
    for matmul in hlo_module.matmuls(hlo_text, branch_weights):
        if not hlo_module.is_fp8(matmul.dtypes):
            by_site[_site(matmul, vocab, experts)] += matmul.flops
    return dict(by_site)


def _site(matmul, vocab, experts):
    instruction = matmul.instruction
    if hlo_module.attention_kernel(instruction) or SCORES.search(instruction.op_name()):
        return 'attention'
    if hlo_module.pallas_kernel(instruction) in grouped_matmul.KERNELS:
        return 'routed experts'
    shapes = matmul.shapes()
    if any(set(dims) & vocab for dims in shapes):
        return 'output layer'
    if experts and matmul.dtypes == 'f32' and any(experts in dims for dims in shapes):
        return 'router'
    return 'block'
