"""The routed experts in FP8 (model/fp8_experts.py): each recipe's expert product and its
gradients within FP8's error of fp32's, and really quantized; under an exchange the
tensorwise scales are the exchange's (each rank's rows scaled as one device scales all of
them); compiled for an H100, the padded exchange's batched products and their gradients are
cuBLASLt FP8 GEMMs; a blockwise MoE step under expert x tensor is one device's (blockwise's
refusal of an expert width off its blocks: tests/test_moe.py's BAD)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import test_expert_parallel
import test_moe
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import fp8_experts
from mtnlg_jax.xla import gpu_compile

X, N_ROWS, K, N = 4, 64, 256, 384
FP8_ERROR = 0.06  # e4m3 keeps 3 mantissa bits: ~4 % RMS on a product, e5m2 (gradients) more


def padded(a, w):
    """The padded exchange's product (model/moe_exchange.py): each expert's rows, its w."""
    return jnp.einsum('xne,xef->xnf', a, w)


def _inputs():
    rows = jax.random.normal(jax.random.key(0), (X, N_ROWS, K))
    w = 0.05 * jax.random.normal(jax.random.key(1), (X, K, N))
    return rows, w


def _loss(matmul, rows, w):
    return (matmul(rows, w) * jnp.cos(jnp.arange(N))).sum()


def _rms_error(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


@pytest.mark.parametrize('recipe', ['tensorwise', 'blockwise'])
def test_each_recipe_is_the_experts_fp32_product_within_fp8s_error_gradients_included(recipe):
    rows, w = _inputs()
    quantized = fp8_experts.quantized(padded, recipe)
    got = jax.grad(functools.partial(_loss, quantized), (0, 1))(rows, w)
    want = jax.grad(functools.partial(_loss, padded), (0, 1))(rows, w)
    errors = [_rms_error(quantized(rows, w), padded(rows, w))]
    errors += [_rms_error(g, v) for g, v in zip(got, want)]
    assert all(1e-3 < e < FP8_ERROR + 0.02 for e in errors), errors  # rounded, not by much


def test_an_exchanges_ranks_scale_their_rows_by_one_max():
    """Over an exchange of 4 ranks (rank 0's rows 2^14 times the others') each rank's product
    with axes = the exchange's is the product of all the rows at once (one scale, their
    max: the same FP8 values; fp32 sums in another order); scaled by its own rows alone,
    the other ranks' products are finer (theirs are subnormal under the shared scale)."""
    rows, w = _inputs()
    rows = rows.at[:, : N_ROWS // 4].multiply(2.0**14)
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((4,), ('expert',), axis_types=auto, devices=jax.devices()[:4])

    def per_rank(axes):
        product = fp8_experts.quantized(padded, 'tensorwise', axes=axes)
        return jax.shard_map(
            product,
            mesh=mesh,
            in_specs=(PartitionSpec(None, 'expert'), PartitionSpec()),
            out_specs=PartitionSpec(None, 'expert'),
            check_vma=False,
        )(rows, w)

    whole = fp8_experts.quantized(padded, 'tensorwise')(rows, w)
    scale = float(np.abs(whole).max())
    np.testing.assert_allclose(per_rank('expert'), whole, rtol=1e-5, atol=1e-6 * scale)
    others = slice(N_ROWS // 4, None)
    own, want = per_rank(())[:, others], padded(rows, w)[:, others]
    assert _rms_error(own, want) < 0.5 * _rms_error(whole[:, others], want)


@pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))
def test_compiled_for_an_h100_the_padded_experts_products_are_fp8_batched_gemms():
    """Tensorwise: the product and both gradients each one batched `__cublas$lt$matmul$f8`
    call, every matmul FLOP of FP8 operands."""
    from mtnlg_jax.model import fp8
    from mtnlg_jax.plan import gpu_target, hlo_module

    devices = gpu_target.devices('h100-80gb', 1)
    whole = NamedSharding(Mesh(devices, ('expert',)), PartitionSpec())
    args = [
        jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=whole) for s in ((X, N_ROWS, K), (X, K, N))
    ]

    def step(rows, w):
        out, pull = jax.vjp(fp8_experts.quantized(padded, 'tensorwise'), rows, w)
        return pull(out)

    with gpu_target.compiling_for(devices):
        jitted = jax.jit(step, compiler_options=fp8.compiler_options('tensorwise'))
        text = jitted.lower(*args).compile().as_text()
    assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 3
    by_dtype = hlo_module.matmul_flops_by_dtype(text)
    assert sum(by_dtype.values()) == 3 * 2 * X * N_ROWS * K * N
    assert all(hlo_module.is_fp8(dtypes) for dtypes in by_dtype), by_dtype


def test_a_blockwise_moe_step_under_expert_and_tensor_is_one_devices(monkeypatch):
    """Blockwise scales are local to tiles and each expert's blocks: the capacity exchange's
    step under expert 4 x tensor 2 is one device's (the CPU's tiles) within fp32's layout
    difference, in fp32 compute (its refusal lifted, as tests/test_fp8_model.py does); both
    run the experts' products through fp8_experts."""
    monkeypatch.setattr(config_lib.checks, '_check_fp8', lambda *_: None)
    calls = []
    wrapped = fp8_experts.quantized
    monkeypatch.setattr(
        fp8_experts, 'quantized', lambda *a, **k: calls.append(k) or wrapped(*a, **k)
    )
    model = dict(moe=test_expert_parallel.CAPACITY, fp8='blockwise')
    test_moe.assert_layout_equals_one_device(model, dict(expert=4, tensor=2), 1e-5)
    assert {k['axes'] for k in calls} == {(), 'expert'}  # one device's tiles, the exchange's
