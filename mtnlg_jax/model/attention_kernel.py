"""Which attention kernel a block runs (attention_kernel): cuDNN's flash attention, the Pallas
flash kernel (Triton on a GPU, interpreted elsewhere), XLA's fused attention on a CPU or the
plain einsums around materialised scores, from model.attention, the device and, under context
parallelism, whether the kernel takes a query chunk at an offset (context_kernel). The
planner asks the same functions (plan/predict.py), so what it prices is what runs.
"""

from mtnlg_jax.config import ConfigError
from mtnlg_jax.model import flash_attention
from mtnlg_jax.model.layers import attention_dims

# The largest head dimension of cuDNN's flash attention by compute capability major (JAX 0.10:
# 128 before Hopper, 256 from it); MT-NLG's 160 fits H100's, not A100's. The Pallas flash
# kernel (model/flash_attention.py) pads the head dimension to a power of two, up to 256.
CUDNN_MAX_HEAD_DIM = {8: 128, 9: 256}


def attention_kernel(cfg, device=None, context=1, documents=False):
    """What Attention runs under model.attention on `device` (the mesh's first; None: the CPU)
    with each sequence over `context` ranks (mesh.context; context_kernel), over packed
    documents masked apart if `documents` (data.reset_attention_mask; documents_kernel):

        'cudnn'  jax.nn.dot_product_attention's cuDNN flash attention (a GPU; no dropout)
        'flash'  the Pallas flash kernel (model/flash_attention.py) as Triton on a GPU, where
                 cuDNN cannot (A100 with head dim 160, attention dropout)
        'flash_interpreted'  the same kernel interpreted, elsewhere (`flash` asked for by
                 name, or `fused` with dropout, on a CPU: the tests)
        'xla'    jax.nn.dot_product_attention on a CPU (`fused` without dropout: the tests)
        'plain'  einsums around the materialised (seq x seq) scores

    auto takes the first of cudnn, flash, plain that can run; fused the first of cudnn, flash
    and refuses what neither can (one ConfigError naming why)."""
    kernel = _kernel(cfg, device)
    _, _, head_dim = attention_dims(cfg)
    if context == 1:
        if documents:
            return documents_kernel(kernel, cfg.seq_len, head_dim, gpu_generation(device))
        return kernel
    return context_kernel(kernel, cfg.seq_len // (2 * context), head_dim, gpu_generation(device))


def documents_kernel(kernel, seq, head_dim, generation):
    """The kernel attention runs over packed documents (segment ids) where `kernel` is
    attention_kernel's choice without them: cuDNN's takes documents only as a (seq x seq)
    mask, which the device builds a sequence at a time (8192 tokens: 64 MiB a sequence, a
    bias cuDNN reads for every head), so the Pallas flash kernel runs in its place where it
    takes the sequence (the segment ids themselves, no mask), else cuDNN with the mask."""
    if kernel != 'cudnn':
        return kernel
    return 'cudnn' if flash_attention.refusal(seq, head_dim, generation) else 'flash'


def context_kernel(kernel, chunk, head_dim, generation):
    """The kernel attention runs under context parallelism (chunks of `chunk` tokens) where
    `kernel` is attention_kernel's choice without it: cuDNN's takes no query offset, so the
    Pallas flash kernel runs in its place where it takes the chunk, else the plain path; any
    other choice as it is (on a CPU 'xla' runs the plain path: Attention.context)."""
    if kernel != 'cudnn':
        return kernel
    return 'plain' if flash_attention.refusal(chunk, head_dim, generation) else 'flash'


def _kernel(cfg, device):
    """attention_kernel without context parallelism."""
    choice = cfg.get('attention', 'plain')
    on_gpu = device is not None and device.platform == 'gpu'
    heads, kv_heads, head_dim = attention_dims(cfg)
    flash_refuses = flash_attention.refusal(cfg.seq_len, head_dim, gpu_generation(device))
    if choice == 'plain':
        return choice
    if choice == 'flash' and flash_refuses:
        raise ConfigError('model.attention', f'the Pallas flash kernel cannot take {flash_refuses}')
    if choice == 'flash':
        return 'flash' if on_gpu else 'flash_interpreted'
    if not on_gpu:
        if choice == 'auto':
            return 'plain'
        return 'flash_interpreted' if cfg.attention_dropout > 0 else 'xla'
    major = gpu_generation(device)
    half = cfg.compute_dtype in ('bfloat16', 'float16')
    limit = CUDNN_MAX_HEAD_DIM.get(major, 256 if major > 9 else 0)
    cudnn_refuses = [
        why
        for failed, why in (
            (not half, f'{cfg.compute_dtype} compute'),
            (head_dim > limit or head_dim % 8, f'head dim {head_dim} (at most {limit} here)'),
            (cfg.attention_dropout > 0, f'attention dropout {cfg.attention_dropout}'),
        )
        if failed
    ]
    if not cudnn_refuses:
        return 'cudnn'
    if half and not flash_refuses:
        return 'flash'
    if choice == 'fused':
        raise ConfigError(
            'model.attention',
            f'no fused kernel runs this: cuDNN cannot fuse {", ".join(cudnn_refuses)}; the '
            f'Pallas flash kernel needs bf16 or fp16 compute and cannot take '
            f'{flash_refuses or cfg.compute_dtype + " compute"}',
        )
    return 'plain'


def gpu_generation(device):
    """The compute capability major of a GPU device (8: A100, 9: H100), else None."""
    if device is None or device.platform != 'gpu':
        return None
    return int(str(getattr(device, 'compute_capability', '8.0')).split('.')[0])
