"""Convert between Hugging Face GPT-2 model directories and workdir checkpoints.

    # import: a workdir whose step-0 checkpoint is the HF model, laid out for this mesh
    python launch/convert.py --import_hf DIR --workdir W [--config configs/gpt2_124m.py] \
        [--config.mesh.tensor=2 --config.KEY=VALUE ...]
    # export: a workdir's checkpoint (default: the newest) as config.json + model.safetensors
    python launch/convert.py --export_hf DIR --workdir W [--step N]

The model keys come from the HF config.json (GPT-2 exactly: tanh GeLU, its layer-norm epsilon,
biases, tied embeddings); every other key (recipe, data, mesh) from --config and its
overrides. The imported workdir trains on with
`launch/train.py --config configs/workdir.py:W --workdir W` under any layout (restoring
reshards). Bad input prints one line `error: ...` and exits with status 2, writing nothing.
"""

import json
import os
import pathlib
import sys

from absl import flags
from ml_collections import config_flags

from mtnlg_jax.cli import fail

ROOT = pathlib.Path(__file__).resolve().parents[1]
_CONFIG = config_flags.DEFINE_config_file(
    'config', str(ROOT / 'configs/gpt2_124m.py'), 'Config of every non-model key (import).'
)
_IMPORT = flags.DEFINE_string('import_hf', None, 'Hugging Face GPT-2 directory to import.')
_EXPORT = flags.DEFINE_string('export_hf', None, 'Directory to export the checkpoint to.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The workdir to write (import) or read (export).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step to export (default: the newest).')


def import_hf(hf_dir, workdir, config):
    import jax

    from mtnlg_jax import checkpoint as checkpoint_lib
    from mtnlg_jax import config as config_lib
    from mtnlg_jax import hf_gpt2
    from mtnlg_jax.parallel.mesh import mesh_from_config
    from mtnlg_jax.train.resume import checkpoint_meta, fresh_counters
    from mtnlg_jax.train.state import make_setup

    try:
        hf_config, tensors = hf_gpt2.read(hf_dir)
        config.model.update(hf_gpt2.model_overrides(hf_config))
        config = config_lib.resolve(config, jax.device_count())
        params = hf_gpt2.params_from_hf(tensors, config.model)
    except (hf_gpt2.HFFormatError, config_lib.ConfigError, ValueError) as e:
        fail(f'--import_hf {hf_dir}: {e}')
    if os.path.isdir(os.path.join(workdir, 'checkpoints')) and os.listdir(
        os.path.join(workdir, 'checkpoints')
    ):
        fail(f'--workdir {workdir} already holds checkpoints; import into a new workdir')
    mesh = mesh_from_config(config)
    setup = make_setup(config, mesh)
    expected = jax.tree.map(lambda a: a.shape, setup.abstract_state['params'])
    if jax.tree.map(lambda a: a.shape, params) != expected:
        fail(f'--import_hf {hf_dir}: parameter shapes do not match the config')

    shardings = setup.state_shardings
    with jax.set_mesh(mesh):
        params = jax.device_put(params, shardings['params'])
        init_opt = jax.jit(setup.optimizer.init, out_shardings=shardings['opt_state'])
        state = dict(params=params, opt_state=init_opt(params), step=jax.numpy.int32(0))
        os.makedirs(workdir, exist_ok=True)
        checkpoints = checkpoint_lib.Checkpoints(workdir, keep=config.checkpoint.keep)
        checkpoints.save(0, state, checkpoint_meta(config, fresh_counters()))
        checkpoints.wait()
        checkpoints.close()
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
        json.dump(config.to_dict(), f, indent=2)
    print(
        f'imported {hf_dir} ({config.model.num_layers} layers, hidden {config.model.hidden}, '
        f'vocab {config.model.vocab_size} padded to {config.model.padded_vocab}) into '
        f'{workdir} at step 0; continue with: python launch/train.py '
        f'--config configs/workdir.py:{workdir} --workdir {workdir}'
    )


def export_hf(hf_dir, workdir, step):
    import jax

    from mtnlg_jax import config as config_lib
    from mtnlg_jax import hf_gpt2
    from mtnlg_jax.eval import workdir as workdir_lib

    try:  # fp32 on one device: the compute copy is then the master copy, bit for bit
        loaded = workdir_lib.load(workdir, step, data=1, tensor=1, dtype='float32')
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))
    tensors = hf_gpt2.hf_from_params(jax.device_get(loaded.params), loaded.config.model)
    hf_gpt2.write(hf_dir, hf_gpt2.hf_config_of(loaded.config.model), tensors)
    print(f'exported step {loaded.step} of {workdir} to {hf_dir}')


def main(argv):
    try:
        flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except (OSError, SyntaxError, AttributeError) as e:
        fail(f'--config: {e}')
    if not _WORKDIR.value:
        fail('--workdir is required')
    if bool(_IMPORT.value) == bool(_EXPORT.value):
        fail('give exactly one of --import_hf DIR and --export_hf DIR')
    if _IMPORT.value:
        import_hf(_IMPORT.value, _WORKDIR.value, _CONFIG.value)
    else:
        export_hf(_EXPORT.value, _WORKDIR.value, _STEP.value)


if __name__ == '__main__':
    main(sys.argv)
