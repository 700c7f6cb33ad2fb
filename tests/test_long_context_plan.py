"""Long context in the planner, without compiling: the kernel attention runs under context
parallelism, the flash kernels' FLOPs by the score blocks they compute, the predicted step's
per-device tokens and context traffic, ZeRO-1 over data x context, and
configs/llama3_405b_128k.py's layout (Llama 3's table 4)."""

import types

import jax
import pytest
from jax.sharding import PartitionSpec

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.model import attention_kernel, flash_attention
from mtnlg_jax.parallel import rules
from mtnlg_jax.plan import arithmetic, clusters, comm, hlo_module, predict

H100 = types.SimpleNamespace(platform='gpu', compute_capability='9.0')
H100_CLUSTER = clusters.CLUSTERS['h100-80gb']


def _model(seq=8192, **more):
    cfg = config_lib.defaults().model
    cfg.update(dict(hidden=1024, heads=8, seq_len=seq, compute_dtype='bfloat16'), **more)
    cfg.attention_dropout = 0.0
    return cfg


@pytest.mark.parametrize(
    'seq, context, kernel',
    [
        (8192, 1, 'cudnn'),
        (8192, 4, 'flash'),  # cuDNN's kernel takes no query offset: the flash kernel's does
        (8200, 4, 'plain'),  # chunks of 1025 tokens: no flash tile divides them
    ],
)
def test_context_parallel_attention_takes_the_flash_kernel_in_place_of_cudnn(seq, context, kernel):
    assert attention_kernel.attention_kernel(_model(seq), H100, context) == kernel
    assert predict.fused_attention(_model(seq), H100_CLUSTER, context) == (kernel != 'plain')


def _flash_call(kernel, q, k, grid=None):
    """A Triton custom call of a flash kernel as it reads in optimized HLO."""
    config = ', '.join(f'grid_{a} = {n} : i32' for a, n in (grid or {}).items())
    dims = (','.join(map(str, q)), ','.join(map(str, k)))
    return hlo_module.Instruction(
        'call',
        f'bf16[{dims[0]}]',
        'custom-call',
        f'(%q, %k), custom_call_target="__gpu$xla.gpu.triton", '
        f'operand_layout_constraints={{bf16[{dims[0]}]{{3,2,1,0}}, bf16[{dims[1]}]{{3,2,1,0}}}}, '
        f'metadata={{op_name="jit(step)/{kernel}/pallas_call"}}, '
        f'backend_config={{debug = false, {config}, ir = "..."}}',
    )


def test_flash_kernels_count_the_score_blocks_they_compute():
    """The forward over 1024 queries in blocks of 128 computes the causal triangle with its
    diagonal blocks whole, 1024 x (1024 + 128) / 2 scores a head; 2 matmuls of 128 lanes. A
    context-parallel chunk of 1024 queries among 4096 keys adds the mean of its pair's
    offsets, (4096 - 1024) / 2, times its queries; dQ's block read from its grid."""
    forward = _flash_call(flash_attention.FORWARD, (1, 1024, 8, 128), (1, 1024, 2, 128))
    assert hlo_module.fused_attention_flops(forward) == 2 * 2 * 8 * 128 * 1024 * 1152 / 2
    chunk = _flash_call(
        flash_attention.QUERY, (1, 1024, 8, 128), (1, 4096, 2, 128), grid=dict(x=1, y=8, z=16)
    )
    area = 1024 * 1536 + 1024 * (1024 + 64) / 2
    assert hlo_module.fused_attention_flops(chunk) == 2 * 3 * 8 * 128 * area
    # a rank's two chunks (r, 2c - 1 - r) against the blocks the kernels walk, by hand
    for context in (2, 4, 16):
        n, keys = 512, 512 * 2 * context
        walked = sum(
            (offset + (i + 1) * 64) * 64 for offset in (n * 1, keys - 2 * n) for i in range(8)
        )
        assert 2 * flash_attention.score_area(n, keys, 64) == walked


CUDNN_TYPE = '(bf16[1,4,8192,128]{3,1,2,0}, f32[1,4,8192]{2,1,0}, u8[0]{0})'


def _cudnn_operands(target):
    """A cuDNN attention call's operands and attributes as XLA:GPU's optimized HLO writes them
    (Llama 3 405B's 8K step with packed documents masked: 1 row, 4 query heads, 8192 x 8192
    scores; trimmed)."""
    bias = ', bf16[1,1,8192,8192]{3,2,1,0}' if 'Bias' in target else ''
    return (
        f'(%q, %k, %v), custom_call_target="{target}", operand_layout_constraints='
        f'{{bf16[1,8192,4,128]{{3,2,1,0}}, bf16[1,8192,2,128]{{3,2,1,0}}{bias}}}, backend_config='
        '{"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", '
        '"dimensions": ["1", "4", "8192", "8192"], "tuple_shapes": []}, "mask_type": "CAUSAL"}}'
    )


def test_cudnn_attention_with_a_mask_is_fused_attention_too():
    """A segment mask (data.reset_attention_mask) reaches cuDNN as a bias, its calls named
    ScaleBias: counted and priced as the unmasked ones (the 405B's 8K point read as unfused,
    its attention neither in the FLOPs nor in the replay)."""
    names = [
        f'__cudnn$fmha{bias}Softmax{bwd}' for bias in ('', 'ScaleBias') for bwd in ('', 'Backward')
    ]
    text = '\n'.join(
        f'  %a{i} = {CUDNN_TYPE} custom-call{_cudnn_operands(n)}' for i, n in enumerate(names)
    )
    assert hlo_module.attention_kernel_counts(text) == dict.fromkeys(names, 1)
    for name in names:
        call = hlo_module.Instruction('a', CUDNN_TYPE, 'custom-call', _cudnn_operands(name))
        matmuls = 5 if name.endswith('Backward') else 2
        assert hlo_module.fused_attention_flops(call) == 2 * matmuls * 4 * 8192 * 8192 * 128


def _llama_128k():
    config = config_lib.load(str(support.ROOT / 'configs/llama3_405b_128k.py'))
    return config_lib.resolve(config, 16384)


def test_the_128k_config_is_meta_s_long_context_layout():
    """Table 4: tensor 8 x context 16 x pipeline 16 x data 8 on 16,384 GPUs, sequence 131072,
    16 M tokens a step; each device holds 8192 tokens of a sequence."""
    config = _llama_128k()
    mesh = config.mesh
    assert (mesh.tensor, mesh.context, mesh.stage, mesh.data) == (8, 16, 16, 8)
    assert config.model.seq_len == 131072
    assert config.train.global_batch * config.model.seq_len == 16 * 2**20
    assert config.train.micro_steps == 16


def test_the_predicted_step_counts_a_context_rank_s_tokens_and_traffic():
    """At context c a layer's matmuls are 1 / c of the whole sequence's and its attention is
    s / c queries against s keys; the keys' and values' gathers are charged; the flash
    kernel's out and log-sum-exp are kept, so selective recompute reruns nothing; the MFU
    divides the model's FLOPs over every device, context ranks included."""
    config = _llama_128k()
    rates = predict._Rates(H100_CLUSTER, predict.FIGURES['h100-80gb'], 'bfloat16')
    whole = config.copy_and_resolve_references()
    whole.mesh.context = 1
    at_c, at_one = (predict.layer_forward(c, rates, 1.0, True) for c in (config, whole))
    assert at_c['flops'] == pytest.approx(at_one['flops'] / 16)
    assert at_c['context'] > 0 == at_one['context']
    step = predict.step_time(config, H100_CLUSTER)
    model = arithmetic.model_flops_per_step(config) / 16384
    peak = H100_CLUSTER.peak_tflops['bfloat16'] * 1e12
    assert step['mfu'] == pytest.approx(model / step['predicted_step_s'] / peak)
    assert step['context_comm_s'] > 0
    assert step['recompute_s'] == 0.0  # selective keeps the flash kernel's out and lse
    sent = comm.comm_bytes_per_device(config)
    assert sent['all-gather']['context'] > 0 and sent['reduce-scatter']['context'] > 0


def test_zero_shards_split_over_context_after_the_replicas():
    """ZeRO-1's shards split over data x context (Megatron's distributed optimizer): the
    128K layout's optimizer state per device is about 1 / (8 x 16) of its compute copy's."""
    sizes = dict(data=2, stage=1, expert=1, context=4, tensor=2)
    spec = rules.state_spec(PartitionSpec(None, 'tensor'), (1024, 512), sizes)
    assert spec == PartitionSpec(('data', 'context'), 'tensor')
    config = _llama_128k()
    compute, zero = arithmetic.local_param_counts(config)
    assert compute / (8 * 16 * 2) < zero < compute / (8 * 8)  # the embeddings: / 2048


def test_no_weight_splits_over_context():
    """The sequence splits over 'context', no weight does (the query projection's kernel named
    its input dimension `seq` once, and so split over 'context')."""
    _, axes = arithmetic.abstract_params(_llama_128k().model)
    for names in jax.tree.leaves(axes, is_leaf=rules.is_axes):
        assert 'context' not in str(rules.logical_to_spec(names)), names
