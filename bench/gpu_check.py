"""Everything on the first GPU we get, in one command (under 10 minutes on one H100).

    make gpu-check      (python bench/gpu_check.py --out runs/gpu_check, on the machine's JAX)
    python bench/gpu_check.py [--out DIR] [--only SECTION ...]

Sections, in order (each a function of bench/gpu_check_kernels.py, gpu_check_train.py,
gpu_check_matmuls.py or gpu_check_collectives.py):

    environment    jax, jaxlib, the CUDA plugin, cuDNN, Python, the device, its compute
                   capability, the XLA flags in force, the packages the model needs
    attention      the flash kernel on the device (not interpreted) against the fp32
                   reference, cuDNN and jax's own Pallas attention: forward and each gradient
                   per leaf, bf16, head dims 64 / 128 / 160, dropout 0 and 0.1 (the
                   reference draws the kernel's own dropout bits; cuDNN and jax's kernel
                   have none of ours, so they are compared at dropout 0)
    kernel_speed   forward and forward + backward ms and TFLOP/s at seq 2048 (ours, cuDNN,
                   jax's Pallas kernel, the plain einsums), ours and cuDNN's at seq 8192
                   (head dim 128), and a small sweep of our blocks and warps (head dim 160)
    train_step     a ~2 B GPT (head dim 160, bf16, selective recompute) on one GPU: tokens/s
                   and MFU after warm-up, with the flash kernel (attention dropout 0.1) and
                   with 'auto' at dropout 0, each beside the plan's predicted step; the loss
                   of flash / cuDNN / plain on one batch
    memory         the device's peak bytes against memory_analysis() and against
                   launch/plan.py's plan for the same config and GPU
    hlo            the compiled step's HLO: copies over 1 MiB inside loops, the attention
                   kernels and how often the forward runs, compiled / model FLOPs
    profile        a jax.profiler trace of two steps, device time split by kind (matmuls,
                   attention, copies, slicing, transposes, collectives, elementwise) beside
                   the replay of the same compile (plan/overlap.py), and again by the kinds
                   the replay gives the kernels' fusions
    grouped_matmul the MoE's Pallas grouped matmul against the fp32 reference (output and
                   both gradients), then timed beside ragged_dot, capacity padding, blocks
    collectives    the MoE exchange's all-to-all and ragged all-to-all beside all-gather and
                   reduce-scatter over every local GPU: each result checked, median ms,
                   algorithm and bus GB/s at 1, 16 and 128 MiB (two GPUs or more)
    fp8            each FP8 recipe's product and gradients against fp32, timed beside bf16,
                   at Llama 3 8B's block shapes; the check's model trained 3 steps under each
                   recipe, its losses and step time against bf16's

OUT/gpu_check.json is rewritten after every section (a run cut off keeps what it measured)
and OUT/gpu_check.md is its markdown table; a section that fails records its error and the
next one runs. Beyond JAX with a CUDA plugin it needs only pure-Python packages (flax, optax,
ml_collections, orbax-checkpoint, numpy, tqdm). On a machine without a GPU it prints one
line saying so and exits 2.
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SECTIONS = (
    'environment',
    'attention',
    'kernel_speed',
    'train_step',
    'memory',
    'hlo',
    'profile',
    'grouped_matmul',
    'collectives',
    'fp8',
)
PURE_PYTHON = ('flax', 'optax', 'ml_collections', 'orbax.checkpoint', 'numpy', 'tqdm')


class Report:
    """The check's results, rewritten whole after each section: OUT/gpu_check.json (atomic:
    written beside, then renamed) and OUT/gpu_check.md."""

    def __init__(self, out, command):
        self.out = pathlib.Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = {
            'command': command,
            'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
            'sections': {},
        }

    def run(self, name, function, *args):
        """function(*args) -> dict, recorded under `name` with its seconds and status; an
        exception is recorded as the section's error (one line) and the check goes on."""
        start = time.perf_counter()
        try:
            result, status = dict(function(*args)), 'ok'
        except Exception as error:  # noqa: BLE001 -- a failed section is a finding, not the end
            message = str(error).strip().splitlines()[0] if str(error).strip() else ''
            result, status = {'error': f'{type(error).__name__}: {message}'[:500]}, 'failed'
        result.update(status=status, seconds=round(time.perf_counter() - start, 1))
        self.results['sections'][name] = result
        self.write()
        print(f'{name}: {status} in {result["seconds"]} s', flush=True)
        return result

    def write(self):
        for path, text in (
            (self.out / 'gpu_check.json', json.dumps(self.results, indent=1, default=str)),
            (self.out / 'gpu_check.md', markdown(self.results)),
        ):
            partial = path.with_suffix(path.suffix + '.partial')
            partial.write_text(text)
            os.replace(partial, path)


def _cell(value):
    if isinstance(value, float):
        return f'{value:.4g}'
    if isinstance(value, (list, tuple)):
        return ', '.join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ', '.join(f'{k} {_cell(v)}' for k, v in value.items())
    return str(value).replace('|', '/')


def table(rows):
    """A markdown table of dicts, columns in the order they first appear."""
    columns = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ['| ' + ' | '.join(columns) + ' |', '|' + '|'.join('---' for _ in columns) + '|']
    lines += ['| ' + ' | '.join(_cell(row.get(c, '')) for c in columns) + ' |' for row in rows]
    return lines


def markdown(results):
    """The results as markdown: a section's scalars as a key / value table, each of its lists
    of rows as a table."""
    lines = ['# GPU check', '', f'command: `{results["command"]}`, started {results["started"]}']
    for name, section in results['sections'].items():
        lines += ['', f'## {name}', '']
        scalars = [
            {'key': key, 'value': value}
            for key, value in section.items()
            if not (isinstance(value, list) and value and isinstance(value[0], dict))
        ]
        lines += table(scalars)
        for key, value in section.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                lines += ['', f'{key}:', '', *table(value)]
    return '\n'.join(lines) + '\n'


def no_gpu_reason():
    """Why this machine cannot run the check (one phrase), or None."""
    import jax  # noqa: PLC0415 -- after the command line is read

    try:
        backend = jax.default_backend()
    except RuntimeError as error:
        return f'JAX found no backend ({error})'
    if backend != 'gpu':
        return f'JAX sees no GPU here (its backend is {backend})'
    return None


def missing_packages():
    return [name for name in PURE_PYTHON if importlib.util.find_spec(name.split('.')[0]) is None]


def environment():
    import jax  # noqa: PLC0415

    from mtnlg_jax.xla import flags  # noqa: PLC0415

    device = jax.devices()[0]
    versions = {}
    for package in ('jax', 'jaxlib', 'jax-cuda12-plugin', 'jax-cuda12-pjrt', 'jax-cuda13-plugin',
                    'jax-cuda13-pjrt', 'flax', 'optax', 'ml_collections', 'orbax-checkpoint',
                    'numpy', 'nvidia-cudnn-cu12', 'nvidia-cudnn-cu13'):  # fmt: skip
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    cudnn = None
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415

        cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
    except (ImportError, AttributeError):
        pass
    return dict(
        python=platform.python_version(),
        versions=versions,
        cudnn=cudnn,
        device=device.device_kind,
        devices=jax.device_count(),
        compute_capability=str(getattr(device, 'compute_capability', 'unknown')),
        xla_flags=os.environ.get('XLA_FLAGS', ''),
        recommended_flags_in_force=flags.describe(),
        recommended_flags_left_out=flags.left_out(),
    )


def fp8():
    """The fp8 section: the products at the 8B's shapes, then the train step's losses."""
    import gpu_check_matmuls  # noqa: PLC0415 -- imports JAX
    import gpu_check_train  # noqa: PLC0415

    products = gpu_check_matmuls.fp8_matmuls()['rows']
    return dict(products=products, train=gpu_check_train.fp8_train()['rows'])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', default='runs/gpu_check', help='folder of the JSON and table')
    parser.add_argument('--only', nargs='*', choices=SECTIONS, help='run these sections only')
    args = parser.parse_args()
    missing = missing_packages()
    if missing:
        sys.exit(f'error: bench/gpu_check.py needs the pure-Python packages {", ".join(missing)} '
                 f'(pip install --no-deps them)')  # fmt: skip
    from mtnlg_jax.xla import flags  # noqa: PLC0415

    flags.apply()  # the recommended XLA:GPU flags, before JAX starts (the user's win)
    reason = no_gpu_reason()
    if reason:
        print(f'error: no GPU: {reason}; bench/gpu_check.py runs on a GPU machine', file=sys.stderr)
        sys.exit(2)
    import gpu_check_collectives  # noqa: PLC0415 -- imports JAX
    import gpu_check_kernels  # noqa: PLC0415
    import gpu_check_matmuls  # noqa: PLC0415
    import gpu_check_train  # noqa: PLC0415

    report = Report(args.out, 'python ' + ' '.join(sys.argv))
    wanted = args.only or SECTIONS
    runs = {
        'environment': (environment,),
        'attention': (gpu_check_kernels.attention,),
        'kernel_speed': (gpu_check_kernels.kernel_speed,),
        'train_step': (gpu_check_train.train_step,),
        'memory': (gpu_check_train.memory,),
        'hlo': (gpu_check_train.hlo,),
        'profile': (gpu_check_train.profile, report.out / 'trace'),
        'grouped_matmul': (gpu_check_matmuls.grouped_matmul,),
        'collectives': (gpu_check_collectives.collectives,),
        'fp8': (fp8,),
    }
    for name in SECTIONS:
        if name in wanted:
            report.run(name, *runs[name])
    print(f'wrote {report.out / "gpu_check.json"} and {report.out / "gpu_check.md"}')


if __name__ == '__main__':
    main()
