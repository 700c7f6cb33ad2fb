"""FP8 matmuls (model/fp8.py): each recipe's product and gradients within FP8's error of the
fp32 ones, and really quantized; blockwise keeps an outlier to its own tile, where one
tensorwise scale loses every other row; compiled for an H100, the forward and both gradients
of tensorwise and delayed are FP8 GEMMs (e4m3 x e4m3, e5m2 x e4m3, e4m3 x e5m2), their
partial sums over `tensor` reduce-scattered in bf16."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtnlg_jax.model import fp8
from mtnlg_jax.xla import gpu_compile

M, K, N = 64, 256, 384
FP8_ERROR = 0.06  # e4m3 keeps 3 mantissa bits: ~4 % RMS on a product, e5m2 (gradients) more


def _inputs(outlier=None):
    x = jax.random.normal(jax.random.key(0), (M, K))
    if outlier is not None:
        x = x.at[3, 5].set(outlier)
    w = 0.05 * jax.random.normal(jax.random.key(1), (K, N))
    return x, w


def _delayed_scales(x, w):
    return fp8.scale_of(fp8.amax(x), fp8.E4M3), fp8.scale_of(fp8.amax(w), fp8.E4M3)


def _rms_error(got, want, rows=slice(None)):
    got, want = np.asarray(got)[rows], np.asarray(want)[rows]
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


@pytest.mark.parametrize('recipe', fp8.RECIPES)
def test_each_recipe_is_the_fp32_product_within_fp8s_error_gradients_included(recipe):
    x, w = _inputs()
    scales = _delayed_scales(x, w) if recipe == 'delayed' else None
    cotangent = jax.random.normal(jax.random.key(2), (M, N))
    got, pull = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe, scales), x, w)
    want, pull_want = jax.vjp(lambda a, b: a @ b, x, w)
    for g, e, bound in [
        (got, want, 0.05),
        *zip(pull(cotangent), pull_want(cotangent), (0.08,) * 2),
    ]:
        error = _rms_error(g, e)
        assert 0.005 < error < bound  # quantized, and within the format's error


@pytest.mark.parametrize('recipe', fp8.RECIPES)
def test_in_bf16_no_dot_asks_for_an_fp32_result_from_16_bit_operands(recipe):
    """XLA:CPU's runtime cannot run a bf16 x bf16 = f32 dot left outside a fusion ("Unsupported
    element type for DotThunk", a one-device blockwise run's first step): bf16 compute's products
    and gradients ask for bf16 (a GEMM accumulates in fp32 either way), and still run."""
    x, w = (v.astype(jnp.bfloat16) for v in _inputs())
    scales = _delayed_scales(x, w) if recipe == 'delayed' else None
    cotangent = jax.random.normal(jax.random.key(2), (M, N), jnp.bfloat16)

    def product_and_gradients(x, w, dy):
        out, pull = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe, scales), x, w)
        return out, *pull(dy)

    jaxpr = jax.make_jaxpr(product_and_gradients)(x, w, cotangent)
    dots = [e for e in jaxpr.eqns if e.primitive.name == 'dot_general']
    assert len(dots) >= 3
    for dot in dots:
        if all(v.aval.dtype.itemsize == 2 for v in dot.invars):
            assert dot.outvars[0].aval.dtype == jnp.bfloat16, dot
    got = jax.jit(product_and_gradients)(x, w, cotangent)[1:]
    for g, e in zip(got, jax.vjp(lambda a, b: a @ b, x, w)[1](cotangent)):
        assert g.dtype == jnp.bfloat16
        assert _rms_error(g.astype(jnp.float32), e.astype(jnp.float32)) < 0.08


def test_blockwise_keeps_an_outlier_to_its_tile():
    x, w = _inputs(outlier=1e6)  # one scale for the tensor flushes the rest below e4m3's range
    want = x @ w
    others = np.arange(M) != 3
    tensorwise = _rms_error(fp8.matmul(x, w, 'tensorwise'), want, others)
    blockwise = _rms_error(fp8.matmul(x, w, 'blockwise'), want, others)
    assert blockwise < FP8_ERROR < 0.5 < tensorwise


def test_delayed_with_this_steps_amax_is_tensorwise_and_bad_recipes_are_refused():
    x, w = _inputs()
    delayed = fp8.matmul(x, w, 'delayed', _delayed_scales(x, w))
    np.testing.assert_array_equal(delayed, fp8.matmul(x, w, 'tensorwise'))
    with pytest.raises(ValueError, match='needs the scales'):
        fp8.matmul(x, w, 'delayed')
    with pytest.raises(ValueError, match="FP8 recipe 'mxfp8'"):
        fp8.matmul(x, w, 'mxfp8')


@pytest.mark.parametrize('recipe', ['tensorwise', 'delayed'])
def test_slots_are_the_product_of_their_stack_and_their_gradients_its_slices(recipe):
    """w as a tuple of slots (SwiGLU's gate and in kernels) is the stacked weight's product,
    one scale over both (the larger slot's), its gradients the stacked gradient's slices."""
    x, w = _inputs()
    other = 40.0 * w  # its amax sets the shared scale
    stacked = jnp.stack([w, other], 1)
    scales = _delayed_scales(x, stacked) if recipe == 'delayed' else None
    cotangent = jax.random.normal(jax.random.key(2), (M, 2, N))
    got, pull = jax.vjp(lambda a, b, c: fp8.matmul(a, (b, c), recipe, scales), x, w, other)
    want, pull_want = jax.vjp(lambda a, s: fp8.matmul(a, s, recipe, scales), x, stacked)
    np.testing.assert_array_equal(got, want)
    dx, dw, d_other = pull(cotangent)
    want_dx, want_dw = pull_want(cotangent)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(jnp.stack([dw, d_other], 1), want_dw)
    if recipe == 'tensorwise':  # w alone takes its own, larger scale: another quantization
        assert not np.array_equal(got[:, 0], fp8.matmul(x, w, recipe))


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
@pytest.mark.parametrize(
    'recipe, gather', [('tensorwise', False), ('delayed', False), ('tensorwise', True)]
)
def test_compiled_for_h100s_the_products_are_fp8_gemms_reduced_in_bf16(recipe, gather):
    """On 2 H100s, the model's column-parallel shape: x split by rows (sequence parallel) and
    gathered, w split by columns over `tensor`. The forward and both gradients are cuBLASLt FP8
    GEMMs (the scales their operands), and the input gradient's partial sums over `tensor`
    are reduce-scattered in bf16: the dot's result is the scaled product (model/fp8.py). x is
    all-gathered in bf16 before the product, or with `gather` handed as its shard and gathered
    once quantized (fp8.matmul's gather): the all-gather in FP8."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax.plan import gpu_target, hlo_module

    rows, k, n = 1024, 512, 768
    devices = gpu_target.devices('h100-80gb', 2)
    mesh = Mesh(devices, ('tensor',))
    by_rows, by_columns = (
        NamedSharding(mesh, PartitionSpec(*s)) for s in (('tensor',), (None, 'tensor'))
    )

    def step(x, w):
        scales = (jnp.float32(2.0), jnp.float32(4.0)) if recipe == 'delayed' else None

        def whole(a):
            return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, PartitionSpec()))

        x, gathers = (x, whole) if gather else (whole(x), None)
        out, pull = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe, scales, gather=gathers), x, w)
        return pull(out)

    args = [
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=by_rows),
        jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=by_columns),
    ]
    with gpu_target.compiling_for(devices):
        jitted = jax.jit(step, out_shardings=(by_rows, by_columns),
                         compiler_options=fp8.compiler_options(recipe))  # fmt: skip
        text = jitted.lower(*args).compile().as_text()
    each = 2 * rows * k * n // 2  # a device's half
    assert hlo_module.matmul_flops_by_dtype(text) == {
        'f8e4m3fn': each,  # the forward
        'f8e5m2 x f8e4m3fn': each,  # the input's gradient
        'f8e4m3fn x f8e5m2': each,  # the weights' gradient
    }
    assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 3
    reduced = re.findall(
        r'= \(*\(?(\w+)\[([\d,]*)\][^=]*? (all-reduce|reduce-scatter)(?:-start)?\(', text
    )
    partial_sums = [(dtype, op) for dtype, dims, op in reduced if dims not in ('', '1', '2')]
    assert partial_sums == [('bf16', 'reduce-scatter')]  # not the amax values' (x's shards')
    gathered = re.findall(r'= \(*\(?(\w+)\[[\d,]*\][^=]*? all-gather(?:-start)?\(', text)
    assert gathered and set(gathered) == {'f8e4m3fn' if gather else 'bf16'}


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
def test_compiled_for_an_h100_blockwise_keeps_its_fp8_rounding_in_three_gemms():
    """Blockwise's three products are bf16 GEMMs of values scaled back from FP8 (x's and w's
    e4m3, dy's e5m2), one GEMM each over all of K (no (K / 128, M, N) partials): XLA:GPU's
    fp-conversion simplification drops a convert to FP8 and back it can see (an H200 measured
    the gradients at bf16's error, 0.29 %, not e5m2's), so the FP8 tiles stay in the program."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax.plan import gpu_target, hlo_module

    rows, k, n = 1024, 512, 768
    devices = gpu_target.devices('h100-80gb', 1)
    whole = NamedSharding(Mesh(devices, ('tensor',)), PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=whole) for s in ((rows, k), (k, n))]

    def step(x, w):
        out, pull = jax.vjp(lambda a, b: fp8.matmul(a, b, 'blockwise'), x, w)
        return pull(out)

    with gpu_target.compiling_for(devices):
        jitted = jax.jit(step, compiler_options=fp8.compiler_options('blockwise'))
        text = jitted.lower(*args).compile().as_text()
    each = 2 * rows * k * n
    assert hlo_module.matmul_flops_by_dtype(text) == {'bf16': 3 * each}
    assert re.search(r'= f8e5m2\[\d+,\d+,128\]', text)  # dy's 1 x 128 tiles
    assert re.search(r'= f8e4m3fn\[\d+,\d+,128\]', text)  # x's
    assert re.search(r'= f8e4m3fn\[\d+,128,\d+,128\]', text)  # w's 128 x 128 blocks


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
@pytest.mark.parametrize('recipe', ['tensorwise', 'blockwise'])
def test_the_plan_names_what_stayed_out_of_fp8_and_why(recipe):
    """Compiled for an H100, a step of one block product in FP8 beside a head over the
    vocabulary, the plain path's attention scores and an fp32 router: the matmuls left in
    bf16 or fp32 are told apart by site (plan/matmul_sites.py), each with its FLOPs, and the
    block product is among them only under blockwise (no per-tile-scaled FP8 GEMM)."""
    import ml_collections
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax.plan import gpu_target, matmul_sites

    rows, k, n, vocab, experts = 1024, 512, 768, 4096, 8
    model = ml_collections.ConfigDict(dict(padded_vocab=vocab, moe=dict(experts=experts)))
    devices = gpu_target.devices('h100-80gb', 1)
    whole = NamedSharding(Mesh(devices, ('tensor',)), PartitionSpec())
    shapes = {'x': (rows, k), 'w': (k, n), 'head': (vocab, k), 'router': (k, experts)}
    args = {
        name: jax.ShapeDtypeStruct(shape, jnp.float32 if name == 'router' else jnp.bfloat16,
                                   sharding=whole)
        for name, shape in shapes.items()
    }  # fmt: skip

    def step(a):
        block = fp8.matmul(a['x'], a['w'], recipe)
        logits = jnp.einsum('...e,ve->...v', a['x'], a['head'])
        q = a['x'][:8].reshape(1, 8, 4, k // 4)  # (b, q, h, d): the plain path's scores
        scores = jnp.einsum('bqhd,bkhd->bhqk', q, q)
        routed = a['x'].astype(jnp.float32) @ a['router']
        return block.sum() + logits.sum() + scores.sum() + routed.sum()

    with gpu_target.compiling_for(devices):
        jitted = jax.jit(step, compiler_options=fp8.compiler_options(recipe))
        text = jitted.lower(args).compile().as_text()
    left = matmul_sites.stayed(text, model, tensor=1)
    want = {
        'output layer': 2 * rows * k * vocab,
        'attention': 2 * 4 * 8 * 8 * (k // 4),
        'router': 2 * rows * k * experts,
    }
    assert left == (want | {'block': 2 * rows * k * n} if recipe == 'blockwise' else want)
    assert 'per-tile' in matmul_sites.reason('block', 'blockwise')


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
def test_compiled_for_h100s_a_row_parallel_products_gradient_is_gathered_in_fp8():
    """On 2 H100s, the model's row-parallel shape: x split by columns, w by rows, the product
    reduce-scattered by rows (sequence parallel) in bf16, so its gradient dy arrives split by
    rows: with gather_dy it is quantized as it lies and gathered so (the gather is handed the
    e5m2 dy), all-gathered in e5m2, and all three products are cuBLASLt FP8 GEMMs."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mtnlg_jax.plan import gpu_target

    devices = gpu_target.devices('h100-80gb', 2)
    mesh = Mesh(devices, ('tensor',))
    by_rows, by_columns = (
        NamedSharding(mesh, PartitionSpec(*s)) for s in (('tensor',), (None, 'tensor'))
    )

    handed = []

    def step(x, w):
        def whole(a):
            handed.append(a.dtype)
            return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, PartitionSpec()))

        def product(a, b):
            out = fp8.matmul(a, b, 'tensorwise', gather_dy=whole)
            return jax.lax.with_sharding_constraint(out, by_rows)

        out, pull = jax.vjp(product, x, w)
        return pull(out)

    args = [
        jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=by_columns),
        jax.ShapeDtypeStruct((512, 768), jnp.bfloat16, sharding=by_rows),
    ]
    with gpu_target.compiling_for(devices):
        jitted = jax.jit(step, out_shardings=(by_columns, by_rows),
                         compiler_options=fp8.compiler_options('tensorwise'))  # fmt: skip
        text = jitted.lower(*args).compile().as_text()
    assert handed == [jnp.float8_e5m2]
    assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 3
    gathered = re.findall(r'= \(*\(?(\w+)\[[\d,]*\][^=]*? all-gather(?:-start)?\(', text)
    assert gathered and set(gathered) == {'f8e5m2'}
    scattered = re.findall(r'= \(*\(?(\w+)\[[\d,]*\][^=]*? reduce-scatter(?:-start)?\(', text)
    assert scattered == ['bf16']


# The three ways a compiled FP8 product can appear (hand-written after XLA:GPU's forms): a
# cuBLASLt FP8 GEMM call (jax 0.11.2 on an H200: its result f32 or bf16, its operands FP8), a
# GEMM fusion whose dot reads its FP8 parameters through a transpose and a bitcast (jax
# 0.10.2's Triton fusions), and a dot of FP8 values converted to bf16 (a bf16 product); and
# an FP8 GEMM call whose operand is not read back to an FP8 type (a u8 view here: how
# another XLA's operands would read, not known).
FP8_HLO = """HloModule fp8_products

%gemm_fusion (p0: f8e4m3fn[64,128], p1: f8e4m3fn[128,32]) -> f32[64,32] {
  %p0 = f8e4m3fn[64,128]{1,0} parameter(0)
  %p1 = f8e4m3fn[128,32]{1,0} parameter(1)
  %t = f8e4m3fn[32,128]{1,0} transpose(%p1), dimensions={1,0}
  %b = f8e4m3fn[128,32]{0,1} bitcast(%t)
  ROOT %d = f32[64,32]{1,0} dot(%p0, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f8e4m3fn[64,128], w: f8e4m3fn[128,32], g: f8e5m2[64,32]) -> f32[64,32] {
  %x = f8e4m3fn[64,128]{1,0} parameter(0)
  %w = f8e4m3fn[128,32]{1,0} parameter(1)
  %g = f8e5m2[64,32]{1,0} parameter(2)
  %s = f32[] constant(1)
  %gemm = (bf16[64,128]{1,0}, s8[1024]{0}) custom-call(%g, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %xb = u8[64,128]{1,0} bitcast-convert(%x)
  %gemm_u8 = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%xb, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %f = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion
  %cx = bf16[64,128]{1,0} convert(%x)
  %cw = bf16[128,32]{1,0} convert(%w)
  %plain = f32[64,32]{1,0} dot(%cx, %cw), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %sum = f32[64,32]{1,0} add(%f, %plain)
}
"""


def test_matmul_flops_by_dtype_reads_the_operands_of_fp8_gemm_calls_and_fusions():
    from mtnlg_jax.plan import hlo_module

    each = 2 * 64 * 128 * 32
    assert hlo_module.matmul_flops_by_dtype(FP8_HLO) == {
        'f8e5m2 x f8e4m3fn': each,  # the cuBLASLt call: its operands, not its bf16 result
        'f8e4m3fn': each,  # the fusion's dot: its parameters' callers, through the layout ops
        'bf16': each,  # converted before the dot: a bf16 product
        'f8': each,  # an FP8 GEMM call whose operand reads as u8: FP8 by its target
    }
