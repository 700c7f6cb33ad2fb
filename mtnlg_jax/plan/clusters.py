"""Named clusters (figures per GPU) and what a plan costs on one: does it fit, and a lower
bound of the iteration time.

    time >= compute at peak + exposed communication + bubble

    compute   Megatron's hardware FLOPs per device / dense peak of the compute dtype
    exposed   tensor-parallel all-reduces (on the critical path in Megatron's layout: each
              layer waits for its own) over NVLink when the tensor group fits in a node, and
              the pipeline hand-offs over the inter-node links; data-parallel traffic is
              taken as hidden behind compute (a bound, not a promise)
    bubble    (p - 1) / (v m) of the ideal time: the stages idle while the pipeline fills
              and drains

Link figures are one direction's bandwidth per GPU (NVLink's 600 / 900 GB/s are both ways).
Next to the bound, `predicted_step_s` (plan/predict.py): the same parts at the achieved
fractions fitted on published step times, the bubble from the engine's own table.
"""

import dataclasses

from mtnlg_jax.config.keys import mesh_devices
from mtnlg_jax.parallel import engine as engine_lib
from mtnlg_jax.plan import comm as comm_lib
from mtnlg_jax.plan import predict
from mtnlg_jax.plan.arithmetic import GIGA


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    peak_tflops: dict  # dense TFLOP/s per GPU by compute dtype
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU, one direction
    internode_bandwidth: float  # bytes/s per GPU, one direction
    # bytes/s, one direction, between a GPU and pinned host memory (its PCIe link): what a
    # pinned-memory copy reaches, about 0.8 of the link's theoretical figure
    host_bandwidth: float
    gpus_per_node: int
    compute_capability: str  # picks the attention kernel (model/attention_kernel.py)


CLUSTERS = {
    'a100-80gb': Cluster(
        name='a100-80gb',
        description='DGX A100 80GB: 8 x A100 SXM, NVLink 600 GB/s, 8 x 200 Gb/s HDR per node',
        peak_tflops={'bfloat16': 312.0, 'float16': 312.0, 'float32': 19.5},
        hbm_bytes=80 * GIGA,
        hbm_bandwidth=2.0e12,
        nvlink_bandwidth=300 * GIGA,
        internode_bandwidth=25 * GIGA,
        host_bandwidth=25e9,  # PCIe Gen4 x16: 32 GB/s theoretical
        gpus_per_node=8,
        compute_capability='8.0',
    ),
    'h100-80gb': Cluster(
        name='h100-80gb',
        description='DGX H100: 8 x H100 SXM, NVLink 900 GB/s, 8 x 400 Gb/s NDR per node',
        # dense: FP8 tensor cores (e4m3 / e5m2 operands) at twice bf16's
        peak_tflops={'bfloat16': 989.0, 'float16': 989.0, 'float32': 67.0, 'float8': 1979.0},
        hbm_bytes=80 * GIGA,
        hbm_bandwidth=3.35e12,
        nvlink_bandwidth=450 * GIGA,
        internode_bandwidth=50 * GIGA,
        host_bandwidth=50e9,  # PCIe Gen5 x16: 64 GB/s theoretical
        gpus_per_node=8,
        compute_capability='9.0',
    ),
}
# An H200 is an H100 with more and faster memory: the same peaks, NVLink, network and host link.
CLUSTERS['h200-141gb'] = dataclasses.replace(
    CLUSTERS['h100-80gb'],
    name='h200-141gb',
    description='DGX H200: 8 x H200 SXM, NVLink 900 GB/s, 8 x 400 Gb/s NDR per node',
    hbm_bytes=141 * GIGA,
    hbm_bandwidth=4.8e12,
)


def _ideal_bubble(config):
    """(p - 1) / (v m) with stages, 0 without."""
    if not engine_lib.engine(config).pipelined:
        return 0.0
    return (config.mesh.stage - 1) / (config.pipeline.repeats * config.train.micro_steps)


def estimate(cluster, config, per_device_total, hardware_flops, comm):
    """Fit and time bound of one step on `cluster` ({...} of JSON-ready numbers).

    per_device_total: planned bytes per device; hardware_flops: Megatron FLOPs per step (the
    whole global batch); comm: comm_bytes_per_device's {kind: {axis: bytes}}."""
    mesh = config.mesh
    devices = mesh_devices(mesh)
    peak = cluster.peak_tflops.get(config.model.compute_dtype)
    compute_s = hardware_flops / devices / (peak * 1e12)
    tensor_link = (
        cluster.nvlink_bandwidth
        if mesh.tensor <= cluster.gpus_per_node
        else cluster.internode_bandwidth
    )
    tensor_bytes = sum(per_axis.get('tensor', 0.0) for per_axis in comm.values())
    stage_bytes = sum(per_axis.get('stage', 0.0) for per_axis in comm.values())
    data_bytes = sum(size for _, _, size in comm_lib.zero_bytes(comm))
    replica = mesh.stage * mesh.tensor
    stage_link = (
        cluster.nvlink_bandwidth
        if replica <= cluster.gpus_per_node
        else cluster.internode_bandwidth
    )
    exposed_s = tensor_bytes / tensor_link + stage_bytes / stage_link
    # (p - 1) / (v m) of the ideal time: Narayanan et al.'s interleaved bubble
    bubble_s = compute_s * _ideal_bubble(config)
    data_link = cluster.internode_bandwidth if devices > cluster.gpus_per_node else tensor_link
    time_s = compute_s + exposed_s + bubble_s
    step = predict.step_time(config, cluster)
    return dict(
        cluster=cluster.name,
        description=cluster.description,
        devices=devices,
        nodes=-(-devices // cluster.gpus_per_node),
        hbm_bytes=cluster.hbm_bytes,
        fits=per_device_total <= cluster.hbm_bytes,
        peak_tflops=peak,
        compute_s=compute_s,
        tensor_comm_s=tensor_bytes / tensor_link,
        pipeline_comm_s=stage_bytes / stage_link,
        data_comm_s=data_bytes / data_link,
        bubble_s=bubble_s,
        iteration_s_lower_bound=time_s,
        tflops_per_gpu_upper_bound=hardware_flops / devices / time_s / 1e12,
        predicted_step_s=step['predicted_step_s'],
        predicted_tflops_per_gpu=step['tflops_per_gpu'],
        predicted_mfu=step['mfu'],
        prediction=step,
    )
