"""Peak dense TFLOP/s of the devices a run may land on: the trainer's MFU reads it.

Keys are substrings of `jax.Device.device_kind`; unknown devices (and every CPU) have no
peak, and MFU is then reported as null. Imports nothing, so it sits with the XLA settings.
"""

DEVICE_PEAK_TFLOPS = {
    'H200': {'bfloat16': 989.0, 'float16': 989.0, 'float32': 67.0},
    'H100': {'bfloat16': 989.0, 'float16': 989.0, 'float32': 67.0},
    'A100': {'bfloat16': 312.0, 'float16': 312.0, 'float32': 19.5},
    'V100': {'float16': 125.0, 'float32': 15.7},
    'TPU v4': {'bfloat16': 275.0},
    'TPU v5p': {'bfloat16': 459.0},
    'TPU v5 lite': {'bfloat16': 197.0},
}


def device_peak_tflops(device, compute_dtype):
    """Peak dense TFLOP/s of one device for the compute dtype, or None if unknown."""
    for kind, peaks in DEVICE_PEAK_TFLOPS.items():
        if kind.lower() in device.device_kind.lower():
            return peaks.get(compute_dtype)
    return None
