"""What a run costs before it runs: arithmetic, cluster figures, and the compiled step.

    arithmetic.py  parameters, FLOPs, bytes per device, communication formulas (no devices)
    clusters.py    per-GPU figures of named clusters (peak FLOP/s, HBM, links)
    comm.py        bytes per step by collective and mesh axis (formulas)
    hlo_module.py  an optimized HLO module's text read: computations, runs per step, FLOPs
    hlo.py         the collective inventory of an optimized HLO module (text in, dicts out)
    compile.py     the train and eval steps launch/train.py runs, compiled ahead of time on
                   abstract state (imports train/: only launch scripts, tests and benchmarks
                   import it, never train/ itself)

`from mtnlg_jax import plan` gives the arithmetic, as train/ uses it.
"""

from mtnlg_jax.plan.arithmetic import (  # noqa: F401
    DEVICE_PEAK_TFLOPS,
    bytes_per_device,
    count_params,
    device_peak_tflops,
    format_bytes,
    megatron_flops_per_step,
    model_flops_per_token,
)
