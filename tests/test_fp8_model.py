"""FP8 in the model (model.fp8, model/fp8_sites.py): the keys refuse what cannot work; every
block matmul and nothing else is an FP8 product; a weight's scale is its whole tensor's under
tensor parallelism; delayed's scales come from its history, and the history resumes exactly
through a checkpoint. The quantised values and scales of each recipe against NumPy."""

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from mtnlg_jax import config as config_lib
from mtnlg_jax.checkpoint import store as checkpoint_lib
from mtnlg_jax.model import fp8, fp8_sites, gpt
from mtnlg_jax.parallel import pipeline
from mtnlg_jax.train import resume
from support import (
    LLAMA_BLOCK,
    TRAIN_ENV,
    assert_trees_close,
    assert_within_leaf_scale,
    gradients_and_values,
    layout,
    random_batches,
    run_launch,
    small_config,
)
from test_buffers import _run


def _config(fp8_recipe='tensorwise', **layout_and_model):
    model = {**LLAMA_BLOCK, 'compute_dtype': 'bfloat16', 'fp8': fp8_recipe}
    return small_config(**{**model, **layout_and_model})


# --- the keys -------------------------------------------------------------------------------


def test_fp8_with_fp32_compute_and_blockwise_off_its_blocks_are_refused():
    with pytest.raises(config_lib.ConfigError, match='model.fp8.*float32'):
        small_config(fp8='tensorwise')  # small_config computes in fp32
    with pytest.raises(config_lib.ConfigError, match='model.fp8.*model.ffn_hidden'):
        _config('blockwise', hidden=256, ffn_hidden=704)


# --- which matmuls ----------------------------------------------------------------------------


def _dots(jaxpr):
    """Every dot_general of a jaxpr, nested ones (the block scan's body) included, each as the
    types it multiplies: an operand dequantized right before the dot (convert(q) x scale,
    model/fp8.py's form of an FP8 GEMM) by q's type, any other by its own."""
    found, producers = [], {}
    for eqn in jaxpr.eqns:
        producers.update({v: eqn for v in eqn.outvars})
        if eqn.primitive.name == 'dot_general':
            found.append(tuple(_multiplied_type(v, producers) for v in eqn.invars))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dots(sub)
    return found


def _multiplied_type(var, producers):
    """q's type where var = convert(q) x scale, q in FP8; else var's own."""
    eqn = producers.get(var)
    if eqn is not None and eqn.primitive.name == 'mul':
        for operand in eqn.invars:
            convert = producers.get(operand)
            if convert is not None and convert.primitive.name == 'convert_element_type':
                source = str(convert.invars[0].aval.dtype)
                if source.startswith('float8'):
                    return source
    return str(var.aval.dtype)


@pytest.mark.parametrize('block', ['gpt', 'llama'])
def test_every_block_matmul_is_fp8_and_nothing_else(block):
    """The forward: one e4m3 x e4m3 product a kernel: GPT's fused QKV (Llama's q and fused
    kv), attention-out, the MLP's in (SwiGLU's gate and in stacked as one) and out; attention's
    scores and context stay bf16, and the output layer is the fused loss's (not in this
    forward)."""
    extra = LLAMA_BLOCK if block == 'llama' else {}
    config = small_config(**{**extra, 'compute_dtype': 'bfloat16', 'fp8': 'tensorwise'})
    model = gpt.create(config.model, 0)
    tokens = jnp.zeros((2, config.model.seq_len), jnp.int32)
    dots = _dots(jax.make_jaxpr(lambda t: model(t))(tokens).jaxpr)
    fp8_dots = [d for d in dots if d == ('float8_e4m3fn',) * 2]
    assert len(fp8_dots) == (5 if block == 'llama' else 4)  # the scan body: one block
    assert sorted(set(dots) - {('float8_e4m3fn',) * 2}) == [('bfloat16', 'bfloat16')]
    assert len(dots) - len(fp8_dots) == 2  # scores and context


# --- layouts ----------------------------------------------------------------------------------


def test_a_weights_scale_is_its_whole_tensors_under_tensor_parallelism():
    """Split over 8 devices by columns (a column-parallel weight), the amax is the global max
    and the FP8 product the one-device product: a scale taken per shard would quantize each
    shard differently."""
    w = jax.random.normal(jax.random.key(1), (64, 256)) * jnp.linspace(0.1, 4.0, 256)
    x = jax.random.normal(jax.random.key(0), (32, 64))
    mesh = jax.make_mesh((8,), ('tensor',))
    split = jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, 'tensor')))
    with jax.set_mesh(mesh):
        amax = jax.jit(fp8.amax)(split)
        product = jax.jit(lambda a, b: fp8.matmul(a, b))(x, split)
    assert float(amax) == float(np.abs(np.asarray(w)).max())
    np.testing.assert_allclose(product, fp8.matmul(x, w), rtol=1e-6, atol=1e-6)
    local = np.concatenate(
        [fp8.matmul(x, w[:, i * 32 : (i + 1) * 32]) for i in range(8)], axis=1
    )  # fmt: skip  (per-shard scales, what must not happen)
    assert not np.allclose(local, product, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('parallel', ['column', 'row'])
def test_a_blockwise_scale_is_its_tiles_or_blocks_whatever_shards_hold_it(parallel):
    """Under data x tensor (4 tensor shards of 64, each half a 128 wide tile or block): a
    column-parallel product (w and dy split by columns) and a row-parallel one (x and w split
    along K) quantize x, w and dy bit for bit as one device, and their product and gradients
    are one device's within fp32's summation order (1.1e-7 of each leaf's largest, measured;
    1e-6 allowed); each shard scaling its own half-tiles would change a tenth of x's FP8
    values or more (what must not happen)."""
    keys = jax.random.split(jax.random.key(0), 3)
    spread = jnp.linspace(0.1, 4.0, 256)  # each shard's amax its own
    x = jax.random.normal(keys[0], (16, 256)) * spread
    w = jax.random.normal(keys[1], (256, 256)) * spread[:, None] * spread
    dy = jax.random.normal(keys[2], (16, 256)) * spread
    mesh = jax.make_mesh((2, 4), ('data', 'tensor'), axis_types=(AxisType.Auto,) * 2)
    P = PartitionSpec
    specs = {  # x, w, dy
        'column': (P('data'), P(None, 'tensor'), P('data', 'tensor')),
        'row': (P('data', 'tensor'), P('tensor'), P('data')),
    }[parallel]

    def step(x, w, dy):
        y, pull = jax.vjp(lambda a, b: fp8.matmul(a, b, 'blockwise'), x, w)
        quantized = fp8._tiles(x, fp8.E4M3, 0), fp8._blocks(w, 0), fp8._tiles(dy, fp8.E5M2, 0)
        return quantized, (y, *pull(dy))

    one_quantized, one = jax.jit(step)(x, w, dy)
    split = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((x, w, dy), specs)]
    with jax.set_mesh(mesh):
        split_quantized, products = jax.jit(step)(*split)
    for got, want in zip(jax.tree.leaves(split_quantized), jax.tree.leaves(one_quantized)):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    assert_within_leaf_scale(products, one, 1e-6)
    halves = [fp8._tiles(x[:, i * 64 : (i + 1) * 64], fp8.E4M3, 0)[0] for i in range(4)]
    local = np.concatenate([_bits(q).reshape(16, 64) for q in halves], axis=1)
    assert (local != _bits(one_quantized[0][0]).reshape(16, 256)).mean() > 0.1


def _bits(v):
    """An array's values as bits where FP8 (NumPy compares FP8 values through floats)."""
    v = np.asarray(v)
    return v.view(np.uint8) if v.dtype.itemsize == 1 else v


# The layouts a step quantizes its weights once in: one scan over the layers; an interleaved
# 1F1B pipeline (2 stages x 2 chunks a stage), each stage's chunks quantized before its ticks.
ONCE_LAYOUTS = {
    'unpipelined': dict(data=2, tensor=2, micro_steps=2),
    'interleaved': dict(data=2, stage=2, tensor=2, repeats=2, num_layers=4, micro_steps=4),
}


@pytest.mark.parametrize(
    'recipe, layout',
    [('tensorwise', 'unpipelined'), ('delayed', 'unpipelined'), ('delayed', 'interleaved')],
)
def test_weights_quantized_once_a_step_give_the_same_step(monkeypatch, recipe, layout):
    """The train step quantizes each weight once (model/fp8_sites.py quantized_weights, under
    data x tensor with sequence parallelism, unpipelined or pipelined): the loss, every
    gradient and delayed's amax values bit for bit those of quantizing in every micro-step,
    and every layer of the block scan was handed its quantized weights. Pipelined, no FP8
    weight is among the residuals a forward stashes per micro-batch (where quantizing in every
    micro-step stashes them). Delayed starts from a history holding w's amax and not x's, so
    its weights are scaled by the history and its inputs by this step's amax; pipelined, its
    amax values are one device's (assert_amax_combined_by_max, on this compile)."""
    if recipe == 'delayed':
        monkeypatch.setattr(fp8_sites, 'history_buffer', _history_of_weights)
    config = _config(recipe, sequence_parallel=True, **ONCE_LAYOUTS[layout])
    batch = random_batches(1)[0]
    handed, stashed = _spy(monkeypatch, fp8_sites, 'layer_weights'), _stashed_fp8(monkeypatch)
    made = _spy(monkeypatch, fp8_sites, 'quantized_weights', returned=True)
    _, once_loss, once, once_values = gradients_and_values(config, batch)
    assert handed and all(w is not None and sorted(w) == LLAMA_SITE_NAMES for w in handed)
    assert all(len(site) == 3 for stack in made for site in stack.values())  # one copy each
    weights = {q_k_last.shape for stack in made for q_k_last, *_ in stack.values()}
    assert weights and not weights & set(stashed)
    each_stashed = _stashed_fp8(monkeypatch)
    monkeypatch.setattr(fp8_sites, 'quantized_weights', lambda *_: None)
    _, each_loss, each, each_values = gradients_and_values(config, batch)
    assert once_loss == each_loss
    assert_trees_close(once, each, atol=0)
    assert_trees_close(once_values, each_values, atol=0)
    assert layout == 'unpipelined' or weights & set(each_stashed)  # what the check would see
    if (recipe, layout) == ('delayed', 'interleaved'):
        assert_amax_combined_by_max(once_values, batch)


def test_blockwise_under_data_tensor_and_an_interleaved_pipeline_is_one_devices_step(
    monkeypatch,
):
    """Blockwise through an interleaved pipeline under data x tensor with sequence parallelism:
    the loss one device's within 1e-5 and every gradient within 5e-2 of its leaf's largest,
    FP8's own coarseness. In fp32 compute (its refusal lifted here), yet the layouts' fp32
    summation orders (1e-7 apart) still flip an FP8 rounding now and then (e4m3 steps 6 to
    12 %, e5m2 25 %): over three batches a flip moved gradients up to 1.2e-2 of a leaf's
    largest, another batch none (docs/benchmarks.md). That a scale is its tile's or block's
    whatever shard holds it, bit for bit: the test above."""
    monkeypatch.setattr(config_lib.checks, '_check_fp8', lambda *_: None)
    layout = dict(ONCE_LAYOUTS['interleaved'], sequence_parallel=True)
    batch = random_batches(1)[0]
    one = gradients_and_values(
        _config('blockwise', compute_dtype='float32', num_layers=4, micro_steps=1), batch
    )
    split = gradients_and_values(_config('blockwise', compute_dtype='float32', **layout), batch)
    assert abs(split[1] - one[1]) < 1e-5
    assert_within_leaf_scale(split[2], one[2], 5e-2, what='gradient')


def assert_amax_combined_by_max(split, batch):
    """A step's fp8_amax is the largest |x| and |w| each site saw over the whole batch: the
    same on one device in one micro-step as over 2 replicas x 4 micro-steps x 2 stages (a sum
    would multiply them). `split`: the side values of ONCE_LAYOUTS['interleaved'] (delayed,
    sequence parallel), whose compile this reads."""
    one = gradients_and_values(_config('delayed', num_layers=4, micro_steps=1), batch)[3]
    want = one[fp8_sites.AMAX]
    assert want.shape == (4, len(fp8_sites.SITES), 2)
    assert (want[:, LLAMA_SITES] > 0).all() and (want[:, fp8_sites.SITES.index('qkv')] == 0).all()
    # bf16 runs of two layouts: up to 6 % apart (an amax is one element); a sum: 2 x or more
    np.testing.assert_allclose(split[fp8_sites.AMAX], want, rtol=0.1)


def test_selective_recompute_keeps_a_row_parallel_products_scale_and_requantizes_its_x():
    """model.remat = selective (gpt.remat_policy) keeps a gathered site's quantized x and
    its scale, but of a row-parallel site (fp8_sites.SCATTERED_SITES: its x whole along the
    sequence, recomputed by the backward anyway) the scale alone: the backward quantizes x
    again by it. The gradients are those of keeping everything, bit for bit, in both recipes
    (delayed scaled from a history, so its kept scale is not x's amax)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (64, 256), jnp.bfloat16)
    w = jax.random.normal(keys[1], (256, 128), jnp.bfloat16) * 0.05
    dy = jax.random.normal(keys[2], (64, 128), jnp.float32)
    history = jnp.zeros((len(fp8_sites.SITES), 2, 4)).at[:, 0, 0].set(3.0)
    for recipe, site in [(r, s) for r in ('tensorwise', 'delayed') for s in ('mlp_up', 'mlp_out')]:

        def f(x, w):
            with fp8_sites.recording(history if recipe == 'delayed' else None):
                out = fp8_sites.project((recipe, 0), site, jnp.sin(x), w)  # x from an op
            return (out.astype(jnp.float32) * dy).sum()

        selective = jax.checkpoint(f, policy=gpt.remat_policy('selective'))
        kept = [r for r in jax.tree.leaves(jax.vjp(selective, x, w)[1]) if r.dtype.itemsize == 1]
        assert [r.shape for r in kept] == ([] if site == 'mlp_out' else [(64, 256)]), site
        assert_trees_close(jax.grad(selective, (0, 1))(x, w), jax.grad(f, (0, 1))(x, w), atol=0)


def test_q_and_kv_keep_one_quantized_x_between_them():
    """Attention's q and kv products of one x (fp8_sites.project's shared, as the block's
    grouped attention calls them): selective recompute keeps one quantized x for both, where
    each quantizing x itself keeps one each; the gradients bit for bit the same (tensorwise,
    and delayed scaled from a history)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (64, 256), jnp.bfloat16)
    wq = jax.random.normal(keys[1], (256, 4, 32), jnp.bfloat16) * 0.05
    wkv = jax.random.normal(keys[2], (256, 2, 2, 32), jnp.bfloat16) * 0.05
    history = jnp.zeros((len(fp8_sites.SITES), 2, 4)).at[:, 0, 0].set(3.0)
    for recipe in ('tensorwise', 'delayed'):

        def f(x, wq, wkv, shared):
            with fp8_sites.recording(history if recipe == 'delayed' else None):
                h = jnp.sin(x)
                q = fp8_sites.project((recipe, 0), 'q', h, wq, shared=shared)
                kv = fp8_sites.project((recipe, 0), 'kv', h, wkv, shared=shared)
            return q.astype(jnp.float32).sum() + (kv.astype(jnp.float32) ** 2).sum()

        grads = {}
        for shared in (True, False):
            g = jax.checkpoint(
                lambda *a, s=shared: f(*a, {} if s else None),
                policy=gpt.remat_policy('selective'),
            )  # fmt: skip
            kept = [r.shape for r in jax.tree.leaves(jax.vjp(g, x, wq, wkv)[1])
                    if r.dtype.itemsize == 1]  # fmt: skip
            assert kept == [(64, 256)] * (1 if shared else 2), (recipe, shared)
            grads[shared] = jax.grad(g, (0, 1, 2))(x, wq, wkv)
        assert_trees_close(grads[True], grads[False], atol=0)


LLAMA_SITE_NAMES = ['attn_out', 'kv', 'mlp_out', 'mlp_up', 'q']


def _spy(monkeypatch, module, name, returned=False):
    """A list of every argument (returned: every result) of module.name, called as before."""
    calls, original = [], getattr(module, name)

    def spy(*args):
        result = original(*args)
        calls.append(result if returned else args[0])
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


def _stashed_fp8(monkeypatch):
    """The shapes of the FP8 residuals a pipelined forward keeps per micro-batch in flight
    (pipeline.probe_layout's), filled in as the engine probes them."""
    shapes, probe = [], pipeline.probe_layout

    def spy(*args):
        kept, layout = probe(*args)
        shapes.extend(r.shape for r in kept if jnp.issubdtype(r.dtype, jnp.floating)
                      and jnp.finfo(r.dtype).bits == 8)  # fmt: skip
        return kept, layout

    monkeypatch.setattr(pipeline, 'probe_layout', spy)
    return shapes


def _history_of_weights(cfg):
    """A block's fp8_history whose newest entry holds 0.25 for each site's w, 0 for its x."""
    history = jnp.zeros((len(fp8_sites.SITES), 2, cfg.fp8_amax_history)).at[:, 1, 0].set(0.25)
    return fp8_sites.buffers.buffer(history, (None, None, None), rule=fp8_sites.RULE)


# --- delayed ----------------------------------------------------------------------------------


# The sites of Llama's block (grouped-query attention: q and a fused kv, no fused qkv).
LLAMA_SITES = [fp8_sites.SITES.index(s) for s in ('q', 'kv', 'attn_out', 'mlp_up', 'mlp_out')]


def test_delayed_history_pushes_each_steps_amax_and_resumes_exactly(tmp_path):
    """4 steps uninterrupted; 2 steps, a checkpoint, a restore, 2 more: the same losses, the
    same history, bit for bit. The history holds each step's amax, newest first."""
    batches = random_batches(4)
    config = _config('delayed', num_layers=4, fp8_amax_history=3)
    config.train.steps = 4
    losses, state = _run(config, batches)
    uninterrupted = jax.device_get(state)
    history = uninterrupted['buffers']['blocks']['fp8_history']
    assert history.shape == (4, len(fp8_sites.SITES), 2, 3)
    assert (history[:, LLAMA_SITES] > 0).all()  # x's and w's amax of the last three steps
    assert not np.array_equal(history[..., 0], history[..., 1])  # each step its own

    half, state = _run(config, batches[:2])
    mesh, setup = layout(config)
    checkpoints = checkpoint_lib.Checkpoints(tmp_path)
    with jax.set_mesh(mesh):
        checkpoints.save(2, state, resume.checkpoint_meta(config, resume.fresh_counters()))
    checkpoints.wait()
    checkpoints.close()
    with jax.set_mesh(mesh):
        checkpoints = checkpoint_lib.Checkpoints(tmp_path)
        position = resume.restore_or_init(config, setup, checkpoints, log=lambda _: None)
        checkpoints.close()
    more, state = _run(config, batches[2:], position.state, first=2)
    np.testing.assert_array_equal(np.concatenate([half, more]), losses)
    assert_trees_close(jax.device_get(state['buffers']), uninterrupted['buffers'], atol=0)
    assert_trees_close(jax.device_get(state['params']), uninterrupted['params'], atol=0)


def test_a100_with_fp8_is_refused_in_one_line():
    result = run_launch(
        'plan.py', '--config', 'configs/tiny_llama.py', '--target', 'a100-80gb',
        '--config.model.compute_dtype=bfloat16', '--config.model.fp8=tensorwise',
        env=TRAIN_ENV,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith('error: config key model.fp8: tensorwise FP8 needs FP8 tensor')


def test_delayed_scales_come_from_the_history_and_the_first_step_from_this_steps_amax():
    x = jax.random.normal(jax.random.key(0), (4, 64)) * 3.0
    w = jax.random.normal(jax.random.key(1), (64, 32)) * 0.05
    empty = jnp.zeros((len(fp8_sites.SITES), 2, 4))
    with fp8_sites.recording(empty) as first:
        out = fp8_sites.project(('delayed', 0), 'mlp_up', x, w)
    np.testing.assert_array_equal(out, fp8.matmul(x, w, 'tensorwise'))  # no history yet
    recorded = first.values(layer=1, num_layers=2)[fp8_sites.AMAX]
    site = fp8_sites.SITES.index('mlp_up')
    np.testing.assert_allclose(recorded[1, site], [fp8.amax(x), fp8.amax(w)])
    assert (recorded[0] == -np.inf).all() and (recorded[1, :site] == 0).all()
    past = empty.at[site, 0, 2].set(100.0).at[site, 1, 0].set(1.0)  # larger than now: smaller
    with fp8_sites.recording(past):
        out = fp8_sites.project(('delayed', 0), 'mlp_up', x, w)
    scales = (fp8.scale_of(100.0, fp8.E4M3), fp8.scale_of(1.0, fp8.E4M3))
    np.testing.assert_array_equal(out, fp8.matmul(x, w, 'delayed', scales))


# --- the quantised values against NumPy --------------------------------------------------------

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _numpy_quantize(v, dtype, amax, margin=0):
    """(q, scale): the scale the power of two putting amax in the format's top binade."""
    top = float(ml_dtypes.finfo(dtype).max)
    limit = top / 2.0**margin
    with np.errstate(divide='ignore'):
        exact = np.exp2(np.floor(np.log2(limit / amax)))
    scale = np.where(amax > 0, exact, 1.0).astype(np.float32)
    assert ((amax * scale <= limit) & ((amax * scale > limit / 2) | (amax == 0))).all()
    return np.clip(v * scale, -top, top).astype(dtype), scale


@pytest.mark.parametrize('margin', [0, 2])
def test_tensorwise_and_delayed_quantize_as_numpy(margin):
    v = np.asarray(jax.random.normal(jax.random.key(3), (16, 256)), np.float32) * 7.0
    for dtype, ours in ((E4M3, fp8.E4M3), (E5M2, fp8.E5M2)):
        want_q, want_scale = _numpy_quantize(v, dtype, np.abs(v).max(), margin)
        scale = fp8.scale_of(fp8.amax(v), ours, margin)
        np.testing.assert_allclose(scale, want_scale, rtol=1e-7)
        got = np.asarray(fp8.quantize(v, ours, scale))
        np.testing.assert_array_equal(got.view(np.uint8), want_q.view(np.uint8))


def test_blockwise_tiles_and_blocks_quantize_as_numpy():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 384)) * rng.uniform(0.01, 100, (8, 1))).astype(np.float32)
    w = (rng.standard_normal((256, 384)) * 0.05).astype(np.float32)
    w[:128, 128:256] *= 1000.0  # one block much larger: its scale alone moves
    q, scale = fp8._tiles(jnp.asarray(x), fp8.E4M3, 0)
    tiles = x.reshape(8, 3, 128)
    want_q, want_scale = _numpy_quantize(tiles, E4M3, np.abs(tiles).max(-1, keepdims=True))
    np.testing.assert_allclose(scale, want_scale, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    q, scale = fp8._blocks(jnp.asarray(w), 0)
    blocks = w.reshape(2, 128, 3, 128)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True)
    want_q, want_scale = _numpy_quantize(blocks, E4M3, amax)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert want_scale[0, 0, 1, 0] < want_scale[0, 0, 0, 0] / 100


def test_model_state_holds_the_history_only_under_delayed():
    for recipe, has in (('tensorwise', False), ('delayed', True)):
        model = gpt.create(_config(recipe).model, 0)
        buffers = nnx.to_pure_dict(nnx.state(model, gpt.Buffer))
        assert ('fp8_history' in buffers.get('blocks', {})) == has
