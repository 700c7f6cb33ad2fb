"""Convert between Hugging Face GPT-2 model directories and workdir checkpoints.

    # import: a workdir whose step-0 checkpoint is the HF model, laid out for this mesh
    python launch/convert.py --import_hf DIR --workdir W [--config configs/gpt2_124m.py] \\
        [--config.mesh.tensor=2 --config.KEY=VALUE ...]
    # ... at a Megatron-LM run's iteration and consumed samples, to continue it there
    python launch/convert.py --import_hf DIR --workdir W --at_step 5000 --samples_consumed 640000
    # export: a workdir's checkpoint (default: the newest) as config.json + model.safetensors,
    # with the run's tokenizer beside them (GPT-2 BPE: vocab.json, merges.txt, tokenizer.json
    # and the tokenizer config; sentencepiece: tokenizer.model)
    python launch/convert.py --export_hf DIR --workdir W [--step N] [--tokenizer PATH]

The model keys come from the HF config.json (GPT-2 exactly: tanh GeLU, its layer-norm epsilon,
biases, tied embeddings); data.tokenizer is the HF directory itself when it holds vocab.json
and merges.txt; every other key (recipe, data, mesh) from --config and its overrides. The
imported workdir trains on with
`launch/train.py --config configs/workdir.py:W --workdir W` under any layout (restoring
reshards). Bad input prints one line `error: ...` and exits with status 2, writing nothing.
"""

import os
import sys

from mtnlg_jax.run import cli
from mtnlg_jax.run.cli import fail
from mtnlg_jax.run.rundir import RunDir, RunDirError

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'configs/gpt2_124m.py')


def parse_args(argv):
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_config(
        default=DEFAULT_CONFIG, help='config of every non-model key (import; default gpt2_124m)'
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument('--import_hf', metavar='DIR', help='Hugging Face GPT-2 to import')
    direction.add_argument('--export_hf', metavar='DIR', help='directory to export to')
    parser.add_argument('--workdir', required=True, help='workdir to write (import) or read')
    parser.add_argument('--step', type=int, help='checkpoint to export (default: the newest)')
    parser.add_argument(
        '--at_step',
        type=int,
        default=0,
        help="import: the step to save at (a Megatron-LM run's iteration, to continue it)",
    )
    parser.add_argument(
        '--samples_consumed',
        type=int,
        default=0,
        help="import: samples the run has consumed (Megatron-LM's consumed_train_samples): "
        'training continues in the data from there, at tokens seen = samples x seq_len',
    )
    parser.add_argument(
        '--tokenizer', help="export: tokenizer to write beside the weights (default: the run's)"
    )
    return parser.parse_args(argv)


def recipe_line(config):
    """What an imported workdir will train with unless overridden: said, since it comes from
    --config and not from the Hugging Face model."""
    opt = config.optimizer
    return (
        f'recipe       from --config: lr {opt.lr:g} after {opt.warmup_tokens:,} warm-up tokens, '
        f'cosine to {opt.min_lr:g} at {opt.decay_tokens:,} tokens, train.steps '
        f'{config.train.steps:,} of {config.train.global_batch} x {config.model.seq_len} tokens '
        f'(override with --config.optimizer.* / --config.train.* when continuing)'
    )


def import_hf(hf_dir, workdir, config, at_step=0, samples_consumed=0):
    import jax

    from mtnlg_jax.checkpoint import store as checkpoint_lib
    from mtnlg_jax import config as config_lib
    from mtnlg_jax.interop import hf_gpt2
    from mtnlg_jax.data import gpt2_bpe
    from mtnlg_jax.parallel.mesh import mesh_from_config
    from mtnlg_jax.train.resume import checkpoint_meta, fresh_counters
    from mtnlg_jax.train.state import make_setup

    try:
        hf_config, tensors = hf_gpt2.read(hf_dir)
        config.model.update(hf_gpt2.model_overrides(hf_config))
        if all(map(os.path.isfile, gpt2_bpe.files_of(hf_dir))):  # its GPT-2 BPE files
            config.data.tokenizer = os.path.abspath(hf_dir)
        config = config_lib.resolve(config, jax.device_count())
        params = hf_gpt2.params_from_hf(tensors, config.model)
    except (hf_gpt2.HFFormatError, config_lib.ConfigError, ValueError) as e:
        fail(f'--import_hf {hf_dir}: {e}')
    run_dir = RunDir(workdir)
    if os.path.isdir(run_dir.checkpoints) and os.listdir(run_dir.checkpoints):
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
        state = dict(params=params, opt_state=init_opt(params), step=jax.numpy.int32(at_step))
        counters = dict(
            fresh_counters(),
            samples_consumed=samples_consumed,
            tokens_seen=samples_consumed * config.model.seq_len,
        )
        checkpoints = checkpoint_lib.Checkpoints(workdir, keep=config.checkpoint.keep)
        checkpoints.save(at_step, state, checkpoint_meta(config, counters))
        checkpoints.wait()
        checkpoints.close()
    run_dir.write_config(config.to_dict())
    print(recipe_line(config))
    print(
        f'imported {hf_dir} ({config.model.num_layers} layers, hidden {config.model.hidden}, '
        f'vocab {config.model.vocab_size} padded to {config.model.padded_vocab}) into '
        f'{workdir} at step {at_step} ({samples_consumed} samples consumed); continue with: '
        f'python launch/train.py --config configs/workdir.py:{workdir} --workdir {workdir}'
    )


def export_hf(hf_dir, workdir, step, tokenizer_path=None):
    """The checkpoint as a Hugging Face GPT-2 directory, with the run's tokenizer beside it
    (none if the run's tokenizer files are missing and --tokenizer names none)."""
    import jax

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.data import tokenizer as tokenizer_lib
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.interop import hf_gpt2

    tokenizer = None
    try:
        model_cfg = workdir_lib.inference_config(workdir_lib.read_saved_config(workdir)).model
        path = tokenizer_path or workdir_lib.read_saved_config(workdir)['data']['tokenizer']
        if tokenizer_path or os.path.exists(path):
            name = '--tokenizer' if tokenizer_path else "the run's data.tokenizer (or --tokenizer)"
            tokenizer = tokenizer_lib.open_tokenizer(path, model_cfg, name)
        # fp32 on one device: the compute copy is then the master copy, bit for bit
        loaded = workdir_lib.load(workdir, step, data=1, tensor=1, dtype='float32')
    except (workdir_lib.WorkdirError, config_lib.ConfigError, tokenizer_lib.TokenizerError) as e:
        fail(str(e))
    tensors = hf_gpt2.hf_from_params(jax.device_get(loaded.params), loaded.config.model)
    eod_id = tokenizer.eod_id if tokenizer else None
    hf_gpt2.write(hf_dir, hf_gpt2.hf_config_of(loaded.config.model, eod_id), tensors)
    written = tokenizer.export(hf_dir, loaded.config.model.seq_len) if tokenizer else []
    with_tokenizer = f' with {", ".join(written)}' if written else ' (no tokenizer found)'
    print(f'exported step {loaded.step} of {workdir} to {hf_dir}{with_tokenizer}')


def main(argv):
    args = parse_args(argv)
    for name in ('at_step', 'samples_consumed'):
        value = getattr(args, name)
        if value < 0 or (value and not args.import_hf):
            fail(f'--{name} must be >= 0 and goes with --import_hf')
    if args.tokenizer and not args.export_hf:
        fail('--tokenizer goes with --export_hf (an import takes the HF directory\'s own)')
    if args.import_hf:
        for name in ('config.json', 'model.safetensors'):
            if not os.path.isfile(os.path.join(args.import_hf, name)):
                fail(f'--import_hf {args.import_hf}: no {name} in it')
        flag = '--workdir'
    else:
        if os.path.exists(args.export_hf) and not os.path.isdir(args.export_hf):
            fail(f'--export_hf {args.export_hf}: exists and is not a directory')
        flag = '--export_hf'
    try:
        RunDir(args.workdir if args.import_hf else args.export_hf).check_writable(flag)
    except RunDirError as e:
        fail(str(e))
    if args.import_hf:
        cli.cpu_devices(cli.mesh_device_count(args.config.mesh))
        import_hf(args.import_hf, args.workdir, args.config, args.at_step, args.samples_consumed)
    else:
        cli.workdir_config(args.workdir)
        cli.cpu_devices(1)
        export_hf(args.export_hf, args.workdir, args.step, args.tokenizer)


if __name__ == '__main__':
    main(sys.argv[1:])
