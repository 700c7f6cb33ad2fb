"""Evaluate a workdir's checkpoint: perplexity, LAMBADA, multiple choice.

    python launch/evaluate.py --workdir runs/tiny --task perplexity --data data/default/kjv \\
        --split valid
    ... --task perplexity --data wiki.test.tokens --overlap 32 --count_words   (WikiText-103)
    ... --task lambada --data lambada_test.jsonl                    ({"text": ...} per line)
    ... --task multiple_choice --data hellaswag.jsonl --shots 1     ({"context", "choices",
                                                                     "answer"} per line)

Perplexity reads a Megatron indexed dataset (--data PREFIX of PREFIX.bin/.idx, as
launch/preprocess.py writes; --split train|valid|test takes that split of its documents under
the run's data.split) or a text file (any other name, tokenised with the run's tokenizer);
with --count_words (text) or --num_words N the word-normalised perplexity of Megatron's
WikiText-103 protocol is reported as well. Results
print as a table and are written as JSON, by default to
WORKDIR/eval/<task>_<data>[_<split>][_shots<N>][_tokens<N>][_limit<N>]_step<N>.json, so
results of different data, shots, parts (--max_tokens, --limit) or steps never overwrite each
other; the output is checked writable before anything is computed. The mesh is the run's
unless --data_parallel / --tensor say otherwise (on a CPU-only machine the tool makes that
many CPU devices itself); any layout reads the checkpoint, parameters only. Bad input prints
one line `error: ...` and exits with status 2 before anything is compiled or written.
"""

import functools
import os
import sys

from mtnlg_jax.run import distributed
from mtnlg_jax.run.cli import (
    ArgumentParser,
    check_output,
    cpu_devices,
    fail,
    workdir_config,
    write_json,
)

TASKS = ('perplexity', 'lambada', 'multiple_choice')


def parse_args(argv):
    parser = ArgumentParser(description=__doc__)
    parser.add_argument('--workdir', required=True, help='a run of launch/train.py')
    parser.add_argument('--step', type=int, help='checkpoint step (default: the newest)')
    parser.add_argument('--task', required=True, choices=TASKS)
    parser.add_argument('--data', required=True, help='indexed dataset prefix, text or jsonl')
    parser.add_argument(
        '--split', choices=('train', 'valid', 'test'), help='perplexity: a split of --data'
    )
    parser.add_argument('--overlap', type=int, default=32, help='perplexity: context tokens')
    words = parser.add_mutually_exclusive_group()
    words.add_argument('--num_words', type=int, help='perplexity: original word count')
    words.add_argument('--count_words', action='store_true', help='count them in the text')
    parser.add_argument('--max_tokens', type=int, help='perplexity: only the first N tokens')
    parser.add_argument('--shots', type=int, default=0, help='multiple choice: solved examples')
    parser.add_argument('--seed', type=int, default=0, help='multiple choice: shot selection')
    parser.add_argument('--limit', type=int, help='only the first N passages or items')
    parser.add_argument('--batch_size', type=int, default=8, help='rows per model call')
    parser.add_argument('--data_parallel', type=int, help='mesh data size (default: the run)')
    parser.add_argument('--tensor', type=int, help='mesh tensor size (default: the run)')
    parser.add_argument(
        '--expert',
        type=int,
        default=1,
        help="mesh expert size: an MoE's experts split over it, the batch too (default 1)",
    )
    parser.add_argument(
        '--tokenizer', help="sentencepiece .model or GPT-2 BPE files (default: the run's)"
    )
    parser.add_argument('--output', help='JSON file (default: WORKDIR/eval/<name>.json, above)')
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


def read_task_data(args, tokenizer, config):
    """The task's input, read and checked before any model is loaded. tokenizer(needed):
    (the run's tokenizer or None, its identity record or None)."""
    import numpy as np

    from mtnlg_jax.data import identity
    from mtnlg_jax.data.gpt_dataset import split_tokens
    from mtnlg_jax.data.indexed import DataError, IndexedDataset
    from mtnlg_jax.eval import tasks

    vocab_size = config.model.vocab_size
    indexed = os.path.isfile(args.data + '.idx')
    if not indexed and not os.path.isfile(args.data):
        fail(f'--data {args.data}: no such file (nor {args.data}.idx)')
    if indexed and args.task != 'perplexity':
        fail(f'--data {args.data}: an indexed dataset; --task {args.task} reads a .jsonl file')
    if args.split and not (indexed and args.task == 'perplexity'):
        fail('--split takes a split of an indexed dataset, for --task perplexity')
    try:
        if args.task == 'perplexity':
            if indexed:
                if args.count_words:
                    fail('--count_words needs a text file; give --num_words for a token file')
                data = IndexedDataset(args.data)
                trained = tokenizer(needed=False)[1]
                identity.check(args.data, trained, f"{args.workdir}'s tokenizer", warn=False)
                tokens = split_tokens(data, args.split, config.data.split)
                num_words = args.num_words
            else:
                with open(args.data, encoding='utf-8') as f:
                    text = f.read()
                tokens = tokenizer()[0].encode_prompt(text)  # a document: Llama 3's BOS first
                num_words = tasks.count_words(text) if args.count_words else args.num_words
            tokens = np.asarray(tokens[: args.max_tokens])
            if tokens.size and int(tokens.max()) >= vocab_size:
                fail(f'--data {args.data}: token id {int(tokens.max())} >= vocab {vocab_size}')
            return tokens, num_words
        fields = dict(text=str) if args.task == 'lambada' else dict(context=str, choices=list)
        if args.task == 'multiple_choice':
            fields['answer'] = int
        records = tasks.read_jsonl(args.data, fields)[: args.limit]
        if args.task == 'multiple_choice':
            tasks.check_choice_items(records)
        return records, None
    except (DataError, tasks.TaskDataError, UnicodeDecodeError) as e:
        fail(f'--data {args.data}: {e}')


def result_name(args, step):
    """<task>_<data>[_<split>][_shots<N>][_tokens<N>][_limit<N>]_step<N>: one file per task,
    data, shots, part of the data and step (a quick partial evaluation never overwrites the
    full one)."""
    data = os.path.basename(args.data.rstrip('/')).rsplit('.', 1)[0] or 'data'
    parts = [args.task, data]
    if args.split:
        parts.append(args.split)
    if args.task == 'multiple_choice':
        parts.append(f'shots{args.shots}')
    if args.max_tokens:
        parts.append(f'tokens{args.max_tokens}')
    if args.limit:
        parts.append(f'limit{args.limit}')
    return '_'.join(parts + [f'step{step}'])


def output_path(args):
    """Where the result goes, checked writable before anything is computed: --output, or
    WORKDIR/eval/<result_name>.json of the step that will be read (None if the workdir has no
    such checkpoint: loading it is the error then)."""
    from mtnlg_jax.run.rundir import RunDir

    if args.output:
        check_output(args.output)
        return args.output
    steps = RunDir(args.workdir).saved_steps()
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    if step not in steps:
        return None
    path = RunDir(args.workdir).eval_output(result_name(args, step))
    check_output(path, '--workdir', make=False)
    return path


def print_table(title, result):
    """A two-column markdown table of the result under its title."""
    rows = [(k, f'{v:.4f}' if isinstance(v, float) else str(v)) for k, v in result.items()]
    width = max(len(key) for key, _ in rows)
    print(f'\n{title}\n\n| {"metric":<{width}} | value |\n|{"-" * (width + 2)}|-------|')
    for key, value in rows:
        print(f'| {key:<{width}} | {value} |')


def main(argv):
    args = parse_args(argv)
    for name in ('batch_size', 'data_parallel', 'tensor', 'expert', 'limit', 'max_tokens',
                 'num_words'):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f'--{name} must be a positive integer, got {value}')
    if args.max_tokens and (args.num_words or args.count_words):
        fail('--max_tokens cuts the text, so the word count would not match: drop one of them')
    output = output_path(args)
    run_mesh = workdir_config(args.workdir)['mesh']
    devices = (args.data_parallel or run_mesh['data']) * (args.tensor or run_mesh['tensor'])
    cpu_devices(max(1, devices * args.expert // distributed.requested_process_count(args)))

    # Before any JAX call; a bad command line has cost no JAX start-up.
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.data import identity
    from mtnlg_jax.eval import tasks
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.eval.scoring import Scorer
    from mtnlg_jax.run.rundir import RunDir

    try:
        saved = workdir_lib.read_saved_config(args.workdir)
        config = workdir_lib.inference_config(
            saved, args.data_parallel, args.tensor, expert=args.expert
        )
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))

    token_file = args.task == 'perplexity' and os.path.isfile(args.data + '.idx')

    @functools.cache
    def tokenizer(needed=True):
        """(the run's tokenizer, its identity record), read when the data asks for it (so a
        bad --data is named first); needed=False: token files only need the record."""
        try:
            return workdir_lib.run_tokenizer(args.workdir, config, args.tokenizer, needed)
        except workdir_lib.WorkdirError as e:
            fail(str(e))

    task_data, num_words = read_task_data(args, tokenizer, config)
    tokenizer(needed=not token_file)  # checked against the run's before the model is read
    if num_words is not None and num_words < 2:
        fail(f'word-normalised perplexity needs at least 2 words, got {num_words}')
    if args.task == 'perplexity' and not 0 <= args.overlap < config.model.seq_len:
        fail(f'--overlap must be in [0, seq_len={config.model.seq_len}), got {args.overlap}')
    if args.task == 'multiple_choice' and args.shots >= len(task_data):
        fail(
            f'--shots {args.shots} needs more than {args.shots} items, --data has {len(task_data)}'
        )
    try:
        loaded = workdir_lib.load(
            args.workdir, args.step, args.data_parallel, args.tensor, expert=args.expert
        )
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))
    if token_file and identity.read(args.data) is None:  # every check passed: now the warning
        identity.warn_once(args.data)
    score = Scorer(loaded, args.batch_size)
    seq_len = loaded.config.model.seq_len
    if args.task == 'perplexity':
        result = tasks.perplexity(score, task_data, seq_len, args.overlap, num_words)
    elif args.task == 'lambada':
        result, _ = tasks.lambada(
            score, tokenizer()[0].encode, [r['text'] for r in task_data], seq_len
        )
    else:
        result, _ = tasks.multiple_choice(
            score, tokenizer()[0].encode, task_data, seq_len, args.shots, args.seed
        )
    mesh = loaded.config.mesh
    record = dict(
        task=args.task,
        workdir=args.workdir,
        step=loaded.step,
        data=os.path.abspath(args.data),
        settings={
            name: getattr(args, name)
            for name in ('split', 'overlap', 'max_tokens', 'num_words', 'shots', 'seed', 'limit')
        },
        mesh=f'data {mesh.data} x tensor {mesh.tensor} on {jax.devices()[0].device_kind}',
        **result,
    )
    if not distributed.is_primary():
        return
    print_table(f'{args.task} of {args.workdir} at step {loaded.step}', result)
    output = output or RunDir(args.workdir).eval_output(result_name(args, loaded.step))
    write_json(output, record, '--output' if args.output else '--workdir')
    print(f'wrote {output}')


if __name__ == '__main__':
    main(sys.argv[1:])
