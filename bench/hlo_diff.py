"""Whether two versions of the code compile the train and eval steps to the same HLO.

    python bench/hlo_diff.py --save DIR            # this checkout's optimized HLO, per layout
    python bench/hlo_diff.py --against DIR         # compare this checkout's with DIR's
    python bench/hlo_diff.py --against DIR --save NEW      # ... and keep this checkout's
    python bench/hlo_diff.py --against DIR --saved NEW     # compare two saved sets

A refactor that claims to change no behaviour proves it here: run --save on the old code
(`git stash`, or a worktree of the old commit with `PYTHONPATH=WORKTREE`: an editable install
imports the checkout it was installed from whatever the working directory), --against on the
new. Each layout (LAYOUTS, a small GPT on 8 XLA:CPU devices) compiles its train step and its
eval step; the optimized HLO (`compiled.as_text()`) is compared with its debug information
aside: `metadata={...}` (op names, source lines: they name the Python that traced the op), the
stack-frame tables, the module's name and the tracer's numbering of instruction names (renamed
by first appearance). Prints one line per step, `same` or the first differing lines; exits 1 if
any differs.
"""

import argparse
import difflib
import os
import re
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
_FLAGS = (
    '--xla_force_host_platform_device_count=8',
    '--xla_disable_hlo_passes=all-reduce-promotion',
)
os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), *_FLAGS]).strip()

# The small GPT every layout starts from (4 layers, hidden 64, 8 heads, seq 32), then its keys.
BASE = dict(num_layers=4, hidden=64, heads=8, seq_len=32, vocab_size=256, remat='none')
INTERLEAVED = dict(stage=2, repeats=2, micro_steps=4, schedule='interleaved')
STEADY = dict(steady_tick=True)
FUSED = dict(fused_accumulation=True)
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)
LLAMA = dict(position='rope', norm='rmsnorm', mlp='swiglu', kv_heads=2, bias=False)
MOE = dict(experts=8, top_k=2, ffn_hidden=32, shared_experts=1, aux_loss_coeff=0.01)
LAYOUTS = {
    'sequential': dict(data=2, tensor=2),
    '1f1b': dict(stage=2, tensor=2, micro_steps=4),
    'interleaved': INTERLEAVED,
    'gpipe': dict(stage=2, repeats=2, micro_steps=4, schedule='gpipe'),
    'dropout': dict(stage=2, tensor=2, micro_steps=4, hidden_dropout=0.1, attention_dropout=0.1),
    'remat_full': dict(stage=2, repeats=2, micro_steps=4, remat='full'),
    'remat_selective': dict(stage=2, repeats=2, tensor=2, micro_steps=4, remat='selective'),
    'sequence_parallel': dict(stage=2, tensor=2, micro_steps=4, sequence_parallel=True),
    'bf16': dict(data=2, stage=2, tensor=2, micro_steps=2, compute_dtype='bfloat16'),
    'sequential_dropout': dict(data=2, hidden_dropout=0.1, micro_steps=2),
    # a mixture of experts (model/moe.py) on mesh.expert 1, as the layouts without it
    'moe': dict(data=2, tensor=2, moe=MOE),
    'moe_1f1b': dict(stage=2, tensor=2, micro_steps=4, moe=MOE),
    # the split backward's schedules (B and W slots: zero_bubble.py, zero_bubble_v.py)
    'zbh1': dict(stage=2, tensor=2, micro_steps=4, schedule='zbh1'),
    'zbv': dict(stage=2, repeats=2, micro_steps=4, schedule='zbv'),
    # the engine's other ticks and backwards: pipeline.steady_tick, fused_accumulation (one
    # chunk a stage, and several: chained.py), overlap_grad_reduce, unequal stages
    'steady': dict(INTERLEAVED, pipeline=STEADY),
    'steady_zbh1': dict(stage=2, tensor=2, micro_steps=4, schedule='zbh1', pipeline=STEADY),
    'fused': dict(stage=2, tensor=2, micro_steps=4, pipeline=FUSED),
    'fused_interleaved': dict(INTERLEAVED, pipeline=FUSED),
    'overlap_grad_reduce': dict(INTERLEAVED, data=2, pipeline=OVERLAP),
    'unequal': dict(stage=2, micro_steps=4, pipeline=dict(first_stage_layers=1)),
    # Llama's block (rope, RMSNorm, SwiGLU, grouped queries), its projections named apart
    'llama_selective': dict(stage=2, tensor=2, micro_steps=4, remat='selective', **LLAMA),
}


def config_of(name):
    from mtnlg_jax import config as config_lib

    keys = {**BASE, **LAYOUTS[name]}
    config = config_lib.defaults()
    config.mesh.update({k: keys.pop(k, 1) for k in config_lib.keys.MESH_AXES})
    micro_steps = keys.pop('micro_steps', 2)
    config.pipeline.update(
        dict(repeats=keys.pop('repeats', 1), schedule=keys.pop('schedule', '1f1b'))
    )
    config.pipeline.update(keys.pop('pipeline', {}))
    config.model.update(dict(compute_dtype='float32', attention_dropout=0.0, hidden_dropout=0.0))
    config.model.update(keys)
    data = config.mesh.data
    config.train.update(dict(global_batch=8 * data, micro_batch=8 // micro_steps, seed=3))
    return config_lib.resolve(config, config_lib.keys.mesh_devices(config.mesh))


STEPS = ('train', 'eval')
DEBUG_SECTIONS = ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames')


def canonical(text):
    """The HLO text with debug information aside: metadata, the stack-frame tables (Python
    files, functions, lines), the module's name."""
    text = re.sub(r',?\s*metadata=\{[^{}]*\}', '', text)
    text = re.sub(r'^HloModule (\S+, )?(is_scheduled=true, )?', 'HloModule ', text, count=1)
    kept, skipping = [], False
    for line in text.splitlines():
        if line.strip() in DEBUG_SECTIONS:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(line)
    return _renamed('\n'.join(kept) + '\n')


def _renamed(text):
    """Instructions, parameters and computations renamed in order of first appearance, their
    numbers dropped (%fusion.41 -> %fusion#7, %constant.263.clone..sunk ->
    %constant.clone..sunk#9): the numbers are the tracer's counter, which an op that XLA
    removes as dead code still advances. A computation's header names its parameters without
    the %."""
    names = {}

    def rename(match):
        name = match.group(0)
        key = name if name.startswith('%') else '%' + name
        if key not in names:
            names[key] = f'{re.sub(r"[.][0-9]+", "", key)}#{len(names)}'
        return names[key] if name.startswith('%') else names[key][1:]

    return re.sub(r'%[\w.\-]+|(?<=[(\s])[\w.\-]+(?=: )', rename, text)


def compiled_texts(name):
    from mtnlg_jax.plan import compile as compile_lib

    config = config_of(name)
    train, _, _ = compile_lib.compile_train_step(config)
    evaluate, _, _ = compile_lib.compile_eval_step(config)
    return {f'{name}.train': train.as_text(), f'{name}.eval': evaluate.as_text()}


def saved_texts(directory, name):
    texts = {}
    for step in STEPS:
        with open(os.path.join(directory, f'{name}.{step}.hlo')) as f:
            texts[f'{name}.{step}'] = f.read()
    return texts


def _in_base(directory, name):
    return all(os.path.exists(os.path.join(directory, f'{name}.{s}.hlo')) for s in STEPS)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--save', help='write this checkout\'s HLO here')
    parser.add_argument('--against', help='compare with the HLO saved here')
    parser.add_argument('--saved', help='compare the HLO saved here instead of compiling')
    parser.add_argument('--layouts', default=','.join(LAYOUTS), help='comma-separated names')
    args = parser.parse_args(argv)
    if not (args.save or args.against) or (args.saved and not args.against):
        print('error: --save DIR, or --against DIR (with --save or --saved)', file=sys.stderr)
        return 2
    names = args.layouts.split(',')
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        print(f'error: --layouts: unknown {unknown} (known: {", ".join(LAYOUTS)})', file=sys.stderr)
        return 2
    if args.against and not os.path.isdir(args.against):
        print(f'error: --against: no such directory {args.against}', file=sys.stderr)
        return 2
    missing = [n for n in names if args.against and not _in_base(args.against, n)]
    if missing and args.layouts != parser.get_default('layouts'):
        print(f'error: --against {args.against} has no {", ".join(missing)}', file=sys.stderr)
        return 2
    if missing:  # a base saved before these layouts existed: compare the others
        print(f'{args.against} has no {", ".join(missing)} (saved before them): not compared')
        names = [n for n in names if n not in missing]
    differ = 0
    for name in names:
        texts = saved_texts(args.saved, name) if args.saved else compiled_texts(name)
        for key, text in texts.items():
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                with open(os.path.join(args.save, key + '.hlo'), 'w') as f:
                    f.write(text)
                print(f'{key:28s} saved ({len(text.splitlines())} lines)')
            if not args.against:
                continue
            with open(os.path.join(args.against, key + '.hlo')) as f:
                before, text = canonical(f.read()), canonical(text)
            if before == text:
                print(f'{key:28s} same ({len(text.splitlines())} lines)')
                continue
            differ += 1
            diff = list(
                difflib.unified_diff(before.splitlines(), text.splitlines(), lineterm='', n=0)
            )
            print(f'{key:28s} DIFFERS ({len(diff)} diff lines)')
            print('\n'.join('    ' + line[:160] for line in diff[:12]))
    return 1 if differ else 0


if __name__ == '__main__':
    sys.exit(main())
