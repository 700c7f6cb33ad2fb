"""Convert between Hugging Face model directories (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE)
and workdir checkpoints.

    # import: a workdir whose step-0 checkpoint is the HF model, laid out for this mesh
    python launch/convert.py --import_hf DIR --workdir W [--config configs/gpt2_124m.py] \\
        [--config.mesh.tensor=2 --config.KEY=VALUE ...]
    # ... at a Megatron-LM run's iteration and consumed samples, to continue it there
    python launch/convert.py --import_hf DIR --workdir W --at_step 5000 --samples_consumed 640000
    # export: a workdir's checkpoint (default: the newest) as config.json + model.safetensors
    # (several files and model.safetensors.index.json above --shard_size), with the run's
    # tokenizer beside them (GPT-2 BPE: vocab.json, merges.txt, tokenizer.json; a Hugging Face
    # tokenizer.json; sentencepiece: tokenizer.model; each with its tokenizer config)
    python launch/convert.py --export_hf DIR --workdir W [--step N] [--tokenizer PATH] \\
        [--dtype bfloat16] [--shard_size 5GB]

DIR is a GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or
Qwen3MoeForCausalLM directory (config.json and model.safetensors, or shards with their index;
config.json in transformers 5's layout or the published checkpoints'; the experts in the Hub's
per-expert tensors). Its config.json fixes the architecture's `model` keys (GPT-2: its shapes,
tanh GeLU, layer norm, learned positions, tied embeddings; Llama: its shapes, GQA, rope and its
llama3 scaling, RMSNorm, SwiGLU, untied embeddings; Qwen3: model.qk_norm too; Mixtral and
Qwen3-MoE: model.moe's experts, top_k, width and renormalisation, interop/hf_variants.py): an
override of one of those that disagrees is refused with one error line, one that agrees is
accepted. The other keys come
from --config and its overrides, which are honoured: the recipe, data, mesh, compute dtype,
recompute, dropout, and, for Llama, seq_len (at most max_position_embeddings). data.tokenizer
is the HF directory's own (vocab.json + merges.txt, or tokenizer.json) unless overridden.
Llama-family weights are read tensor by tensor, each device reading its own shard of each
parameter from the files (its own experts' tensors only), so the whole model is never in one
host's memory; export reads the
checkpoint's files on the host, one layer of one parameter at a time, with no device, and
writes each as it is read. The imported workdir trains on with
`launch/train.py --config configs/workdir.py:W --workdir W` under any layout (restoring
reshards). Bad input prints one line `error: ...` and exits with status 2, writing nothing.
"""

import json
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
    direction.add_argument(
        '--import_hf', metavar='DIR', help='Hugging Face GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE'
    )
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
    parser.add_argument(
        '--dtype', choices=DTYPES, help='export: the weights\' dtype (default float32: exact)'
    )
    parser.add_argument(
        '--shard_size', help='export: largest weights file before splitting (default 5GB)'
    )
    return parser.parse_args(argv)


DTYPES = ('float32', 'bfloat16')
UNITS = {'': 1, 'B': 1, 'KB': 1000, 'MB': 1000**2, 'GB': 1000**3, 'TB': 1000**4}


def parse_size(text):
    """Bytes of '5GB', '500MB', '40KB' or a plain integer; None if it is none of these."""
    number = text.rstrip('KMGTBkmgtb')
    unit = text[len(number) :].upper()
    if not number.isdigit() or unit not in UNITS or int(number) <= 0:
        return None
    return int(number) * UNITS[unit]


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


def read_hf_config(hf_dir):
    """config.json of an HF directory as a dict; an error line if it is not a JSON object."""
    path = os.path.join(hf_dir, 'config.json')
    try:
        with open(path) as f:
            hf_config = json.load(f)
    except (OSError, ValueError) as e:
        fail(f'--import_hf {hf_dir}: {path} is not readable JSON ({e})')
    if not isinstance(hf_config, dict):
        fail(f'--import_hf {hf_dir}: {path} is not a JSON object')
    return hf_config


def model_config(hf_dir, hf_config, config, overrides):
    """`config` with the model keys of the HF config.json: the architecture's fixed (an
    override that disagrees is refused), the others (dropout, init, Llama's seq_len) only
    where not overridden; data.tokenizer the directory's own unless overridden."""
    from mtnlg_jax.data import gpt2_bpe
    from mtnlg_jax.interop import hf_gpt2, hf_llama, hf_variants

    kind = hf_kind(hf_config)
    fixed = kind.model_keys(hf_config)
    if any(key not in config.model for key in fixed):
        missing = sorted(key for key in fixed if key not in config.model)
        if kind is not hf_gpt2:
            fail(f'--import_hf {hf_dir}: a Llama needs the model keys {missing}')
        fixed = {key: value for key, value in fixed.items() if key in config.model}
    for key, text in overrides.items():
        name = key.removeprefix('model.')
        top = name.split('.')[0]
        if key.startswith('model.') and top in fixed:
            given, theirs = config.model[top], fixed[top]
            if hasattr(given, 'to_dict'):
                given = {k: given[k] for k in theirs}
            if given != theirs:
                fail(
                    f'--config.{key}={text}: the architecture comes from --import_hf {hf_dir} '
                    f'(config.json gives model.{top} = {theirs!r}); drop the override'
                )
    for name, value in kind.model_defaults(hf_config).items():
        if f'model.{name}' not in overrides:
            config.model[name] = value
    config.model.update(fixed)
    limit = kind.max_seq_len(hf_config) if kind in (hf_llama, hf_variants) else None
    if limit and config.model.seq_len > limit:
        if 'model.seq_len' in overrides:
            fail(f'--config.model.seq_len={config.model.seq_len}: --import_hf {hf_dir} has '
                 f'max_position_embeddings {limit}')  # fmt: skip
        config.model.seq_len = limit
    if 'data.tokenizer' not in overrides:
        if all(map(os.path.isfile, gpt2_bpe.files_of(hf_dir))):  # its GPT-2 BPE files
            config.data.tokenizer = os.path.abspath(hf_dir)
        elif os.path.isfile(os.path.join(hf_dir, 'tokenizer.json')):
            config.data.tokenizer = os.path.abspath(os.path.join(hf_dir, 'tokenizer.json'))
    return kind


def hf_kind(hf_config):
    """The interop module of a config.json: hf_llama, hf_variants (Qwen3, Mixtral, Qwen3-MoE)
    or hf_gpt2 (whose model_keys refuses what is not GPT-2); HFFormatError naming another
    model_type (a DeepSeek-V3 or Qwen2-MoE would otherwise be read as a broken GPT-2)."""
    from mtnlg_jax.interop import hf_gpt2, hf_llama, hf_variants

    if hf_llama.is_llama(hf_config):
        return hf_llama
    if hf_variants.is_variant(hf_config):
        return hf_variants
    known = ('gpt2', 'llama', *hf_variants.CLASSES)
    if hf_config.get('model_type', 'gpt2') not in known:
        raise hf_llama.HFFormatError(
            f'config.json model_type {hf_config["model_type"]!r}: only {", ".join(known)}'
        )
    return hf_gpt2


def import_hf(hf_dir, workdir, config, at_step=0, samples_consumed=0, overrides=None):
    """overrides: {dotted key: text} given on the command line (what the user asked for)."""
    import jax

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.checkpoint import store as checkpoint_lib
    from mtnlg_jax.interop import hf_gpt2, hf_llama, safetensors_files
    from mtnlg_jax.parallel.mesh import mesh_from_config
    from mtnlg_jax.train.resume import checkpoint_meta, fresh_counters
    from mtnlg_jax.train.state import make_setup

    hf_config = read_hf_config(hf_dir)
    errors = (hf_gpt2.HFFormatError, hf_llama.HFFormatError, safetensors_files.SafetensorsError,
              config_lib.ConfigError, ValueError)  # fmt: skip
    try:
        kind = model_config(hf_dir, hf_config, config, overrides or {})
        config = config_lib.resolve(config, jax.device_count())
        reader = safetensors_files.Reader(hf_dir)
        mesh = mesh_from_config(config)
        setup = make_setup(config, mesh)
        if kind is not hf_gpt2:
            # checkpoints hold the layers in layer order (padded stages: parallel/stage_order.py)
            abstract = setup.layer_abstract_state['params']
            shardings = setup.layer_state_shardings['params']
            params = hf_llama.params_on_mesh(reader, abstract, shardings, config.model)
        else:
            params = hf_gpt2.params_from_hf(hf_gpt2.read(hf_dir)[1], config.model)
    except errors as e:
        fail(f'--import_hf {hf_dir}: {e}')
    run_dir = RunDir(workdir)
    if os.path.isdir(run_dir.checkpoints) and os.listdir(run_dir.checkpoints):
        fail(f'--workdir {workdir} already holds checkpoints; import into a new workdir')
    expected = jax.tree.map(lambda a: a.shape, setup.layer_abstract_state['params'])
    if jax.tree.map(lambda a: a.shape, params) != expected:
        fail(f'--import_hf {hf_dir}: parameter shapes do not match the config')

    shardings = setup.layer_state_shardings  # checkpoints hold the layers in layer order
    with jax.set_mesh(mesh):
        params = jax.device_put(params, shardings['params'])
        init_opt = jax.jit(setup.optimizer.init, out_shardings=shardings['opt_state'])
        state = dict(params=params, opt_state=init_opt(params), step=jax.numpy.int32(at_step))
        if 'buffers' in shardings:  # their initial values (a router's bias: 0, HF has none)
            state['buffers'] = initial_buffers(config, shardings['buffers'])
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


def initial_buffers(config, shardings):
    """The model's buffers (model/buffers.py) as it initialises them, in layer order, laid
    out by `shardings`: only they are computed (the rest of the model is dead code)."""
    import jax

    from mtnlg_jax.model import gpt

    def init():
        return gpt.buffers(gpt.create(config.model, config.train.seed))[0]

    return jax.jit(init, out_shardings=shardings)()


def hf_kind_of(model_cfg):
    """hf_llama, hf_variants (q/k norms or experts) or hf_gpt2, whichever Hugging Face class
    holds this block; None: none."""
    from mtnlg_jax.interop import hf_gpt2, hf_llama, hf_variants

    gpt2 = hf_gpt2.block_keys()  # a key the config lacks has GPT's default
    for kind in (hf_llama, hf_gpt2):
        if all(model_cfg.get(k, gpt2[k]) == v for k, v in kind.block_keys().items()):
            if hf_llama.architecture(model_cfg) == 'LlamaForCausalLM':
                return kind
            return hf_variants if kind is hf_llama else None
    return None


def export_hf(hf_dir, workdir, step, tokenizer_path=None, dtype=None, shard_bytes=None):
    """The checkpoint as a Hugging Face GPT-2 or Llama directory, with the run's tokenizer
    beside it (none if the run's tokenizer files are missing and --tokenizer names none). The
    weights are read from the checkpoint's files on the host, a layer of one parameter at a
    time (Llama; GPT-2's whole), and written as read: no device holds the model."""
    import jax
    import ml_dtypes
    import numpy as np

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.data import tokenizer as tokenizer_lib
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.interop import hf_gpt2, hf_llama, hf_variants, safetensors_files

    tokenizer = None
    try:
        saved = workdir_lib.read_saved_config(workdir)
        config = workdir_lib.inference_config(saved, 1, 1)
        model_cfg = config.model
        kind = hf_kind_of(model_cfg)
        if kind is None:
            fail(f'--workdir {workdir}: no Hugging Face class holds this block (Llama and its '
                 'variants: rope, rmsnorm, swiglu; GPT-2: learned positions, layernorm, gelu, '
                 'tied, without model.qk_norm or model.moe.experts)')  # fmt: skip
        if kind is hf_variants and hf_variants.unexportable(model_cfg):
            fail(f'--workdir {workdir}: {hf_variants.unexportable(model_cfg)}')
        path = tokenizer_path or saved['data']['tokenizer']
        if tokenizer_path or os.path.exists(path):
            name = '--tokenizer' if tokenizer_path else "the run's data.tokenizer (or --tokenizer)"
            tokenizer = tokenizer_lib.open_tokenizer(path, model_cfg, name)
        step = workdir_lib.checkpoint_step(workdir, step)
        # fp32, the master copy as saved: the checkpoint's own values, bit for bit
        read, shapes = workdir_lib.layer_reader(workdir, step, config)
        if kind is hf_variants and model_cfg.moe.experts:
            why = hf_variants.check_router_bias(
                model_cfg, read.buffers(('blocks', 'moe', 'router_bias'))
            )
            if why:
                fail(f'--workdir {workdir} step {step}: {why}')
    except (workdir_lib.WorkdirError, config_lib.ConfigError, tokenizer_lib.TokenizerError) as e:
        fail(str(e))
    out_dtype = ml_dtypes.bfloat16 if dtype == 'bfloat16' else np.float32
    eod_id = tokenizer.eod_id if tokenizer else None
    bos_id = getattr(tokenizer, 'bos_id', None)
    if kind is not hf_gpt2:
        paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
        hf_config = kind.hf_config_of(model_cfg, bos_id, eod_id, dtype or 'float32')
        tensors = hf_llama.hf_tensors(paths, read, model_cfg, out_dtype)
    else:
        hf_config = kind.hf_config_of(model_cfg, eod_id)
        params = jax.tree_util.tree_map_with_path(
            lambda p, _: read(tuple(k.key for k in p)), shapes
        )
        gpt2 = kind.hf_from_params(params, model_cfg).items()
        tensors = ((name, value.astype(out_dtype)) for name, value in gpt2)
    shard_bytes = shard_bytes or safetensors_files.DEFAULT_SHARD_BYTES
    files = safetensors_files.write(hf_dir, tensors, shard_bytes)
    with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
        json.dump(hf_config, f, indent=2)
    written = tokenizer.export(hf_dir, model_cfg.seq_len) if tokenizer else []
    with_tokenizer = f' with {", ".join(written)}' if written else ' (no tokenizer found)'
    print(f'exported step {step} of {workdir} to {hf_dir}: config.json, '
          f'{", ".join(files)}{with_tokenizer}')  # fmt: skip


def check_import_dir(hf_dir):
    from mtnlg_jax.interop import safetensors_files

    if not os.path.isfile(os.path.join(hf_dir, 'config.json')):
        fail(f'--import_hf {hf_dir}: no config.json in it')
    if not any(
        os.path.isfile(os.path.join(hf_dir, name))
        for name in (safetensors_files.SINGLE, safetensors_files.INDEX)
    ):
        fail(f'--import_hf {hf_dir}: no {safetensors_files.SINGLE} (or '
             f'{safetensors_files.INDEX}) in it')  # fmt: skip


def main(argv):
    args = parse_args(argv)
    for name in ('at_step', 'samples_consumed'):
        value = getattr(args, name)
        if value < 0 or (value and not args.import_hf):
            fail(f'--{name} must be >= 0 and goes with --import_hf')
    if args.tokenizer and not args.export_hf:
        fail('--tokenizer goes with --export_hf (an import takes the HF directory\'s own)')
    for name in ('dtype', 'shard_size'):
        if getattr(args, name) is not None and not args.export_hf:
            fail(f'--{name} goes with --export_hf')
    shard_bytes = None
    if args.shard_size is not None:
        shard_bytes = parse_size(args.shard_size)
        if shard_bytes is None:
            fail(f'--shard_size {args.shard_size}: give bytes, or a number with KB, MB or GB')
    if args.import_hf:
        check_import_dir(args.import_hf)
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
        import_hf(args.import_hf, args.workdir, args.config, args.at_step, args.samples_consumed,
                  args.config_overrides)  # fmt: skip
    else:
        cli.workdir_config(args.workdir)
        export_hf(args.export_hf, args.workdir, args.step, args.tokenizer, args.dtype,
                  shard_bytes)  # fmt: skip


if __name__ == '__main__':
    main(sys.argv[1:])
