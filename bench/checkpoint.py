"""Checkpoint cost of a config: save (blocking and total), size on disk, restore onto the same
and onto another layout, measured in one process on 8 simulated devices.

    python bench/checkpoint.py [--configs configs/tiny.py configs/gpt2_124m.py]

Columns: the config and its state (fp32 parameters + two Adam moments, all filled with noise
as after training); `save blocks`, how
long `Checkpoints.save` holds the training loop (copying the shards off the devices: the
rest is written by orbax's background thread while training goes on); `save total`, until
the checkpoint is complete on disk; the size of the step directory; restore into the layout
that saved it and into another (which reads the same files into other shards, and pads the
vocabulary when the tensor size changes it). Each save is the second of two (the first
warms up orbax); restores read files the page cache may hold, as a resume right after a
save would.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mtnlg_jax.checkpoint import store as checkpoint_lib  # noqa: E402
from mtnlg_jax import config as config_lib  # noqa: E402
from mtnlg_jax.model import counts  # noqa: E402
from mtnlg_jax.parallel import footprint  # noqa: E402
from mtnlg_jax.parallel.mesh import mesh_from_config  # noqa: E402
from mtnlg_jax.train import resume  # noqa: E402
from mtnlg_jax.train.state import init_state, make_setup  # noqa: E402

# (saved under, restored under): data x stage x tensor
LAYOUTS = {
    'configs/tiny.py': ((4, 1, 2), (2, 1, 4)),
    'configs/gpt2_124m.py': ((8, 1, 1), (2, 1, 4)),  # tensor 4 pads the vocabulary further
}


def layout_of(path, data, stage, tensor):
    config = config_lib.load(path)
    config.mesh.update(dict(data=data, stage=stage, tensor=tensor))
    config.train.micro_batch = 1
    config.train.global_batch = 8 * data  # the batch plays no part in a checkpoint
    config = config_lib.resolve(config, data * stage * tensor)
    return config, make_setup(config, mesh_from_config(config))


def as_if_trained(state, setup):
    """The state with noise in every float array: at init the Adam moments are zeros, which
    orbax's zstd compression stores in almost nothing; after training they are not."""

    def noisy(tree):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        return treedef.unflatten(
            [
                leaf + 1e-3 * jax.random.normal(key, leaf.shape, leaf.dtype)
                if jnp.issubdtype(leaf.dtype, jnp.floating)
                else leaf
                for leaf, key in zip(leaves, keys)
            ]
        )

    return jax.jit(noisy, out_shardings=setup.state_shardings, donate_argnums=0)(state)


def directory_bytes(path):
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def timed_restore(workdir, config, setup):
    with jax.set_mesh(setup.mesh):
        checkpoints = checkpoint_lib.Checkpoints(workdir)
        start = time.perf_counter()
        position = resume.restore_or_init(config, setup, checkpoints, log=lambda _: None)
        jax.block_until_ready(position.state)
        seconds = time.perf_counter() - start
        checkpoints.close()
    return seconds


def measure(path, workdir):
    saved_under, restored_under = LAYOUTS[path]
    config, setup = layout_of(path, *saved_under)
    meta = resume.checkpoint_meta(config, resume.fresh_counters())
    with jax.set_mesh(setup.mesh):
        state = as_if_trained(init_state(config, setup), setup)
        jax.block_until_ready(state)
        checkpoints = checkpoint_lib.Checkpoints(workdir, keep=1)
        checkpoints.save(1, state, meta)  # warm-up
        checkpoints.wait()
        start = time.perf_counter()
        checkpoints.save(2, state, meta)
        blocking = time.perf_counter() - start
        checkpoints.wait()
        total = time.perf_counter() - start
        checkpoints.close()
    del state
    size = directory_bytes(os.path.join(workdir, 'checkpoints', '2'))
    same = timed_restore(workdir, config, setup)
    other_config, other_setup = layout_of(path, *restored_under)
    other = timed_restore(workdir, other_config, other_setup)
    return dict(
        config=os.path.basename(path),
        params=counts.count_params(setup.layer_abstract_state['params']),
        saved_under=' x '.join(map(str, saved_under)),
        restored_under=' x '.join(map(str, restored_under)),
        blocking=blocking,
        total=total,
        size=size,
        same=same,
        other=other,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--configs', nargs='+', default=list(LAYOUTS))
    args = parser.parse_args()
    rows = []
    for path in args.configs:
        workdir = tempfile.mkdtemp(prefix='bench_checkpoint_')
        try:
            rows.append(measure(path, workdir))
        finally:
            shutil.rmtree(workdir)
    print(f'command: python {" ".join(sys.argv)}')
    print(f'machine: {jax.devices()[0].device_kind}, {os.cpu_count()} cores, jax {jax.__version__}')
    header = (
        '| config | parameters | saved under | save blocks s | save total s | size on disk '
        '| restore same layout s | restored under | restore other layout s |'
    )
    print(header)
    print('|' + '|'.join('---' for _ in header.split('|')[1:-1]) + '|')
    for row in rows:
        print(
            f'| {row["config"]} | {row["params"] / 1e6:.1f} M | {row["saved_under"]} '
            f'| {row["blocking"]:.3f} | {row["total"]:.2f} | {footprint.format_bytes(row["size"])} '
            f'| {row["same"]:.2f} | {row["restored_under"]} | {row["other"]:.2f} |'
        )


if __name__ == '__main__':
    main()
