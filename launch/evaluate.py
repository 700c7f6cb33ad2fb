"""Evaluate a workdir's checkpoint: perplexity, LAMBADA, multiple choice.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python launch/evaluate.py \
        --workdir runs/tiny --task perplexity --data data/default/kjv --split valid
    ... --task perplexity --data wiki.test.tokens --overlap 32 --count_words   (WikiText-103)
    ... --task lambada --data lambada_test.jsonl                    ({"text": ...} per line)
    ... --task multiple_choice --data hellaswag.jsonl --shots 1     ({"context", "choices",
                                                                     "answer"} per line)

Perplexity reads a Megatron indexed dataset (--data PREFIX of PREFIX.bin/.idx, as
launch/preprocess.py writes; --split train|valid|test takes that split of its documents under
the run's data.split) or a text file (any other name, tokenised with the run's tokenizer); with --count_words (text) or --num_words N the
word-normalised perplexity of Megatron's WikiText-103 protocol is reported as well. Results
print as a table and are written as JSON (default DIR/eval/<task>_step<N>.json). The mesh is
the run's unless --data_parallel / --tensor say otherwise; any layout reads the checkpoint.
Bad input prints one line `error: ...` and exits with status 2 before anything is compiled.
"""

import argparse
import json
import os
import sys

from mtnlg_jax.cli import ArgumentParser, fail

TASKS = ('perplexity', 'lambada', 'multiple_choice')


def parse_args(argv):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    parser.add_argument('--tokenizer', help="sentencepiece model (default: the run's)")
    parser.add_argument('--output', help='JSON file (default: WORKDIR/eval/TASK_stepN.json)')
    return parser.parse_args(argv)


def indexed_tokens(prefix, split, data_split):
    """The tokens of an indexed dataset's documents, all or those of one split."""
    import numpy as np

    from mtnlg_jax.data.gpt_dataset import split_ranges
    from mtnlg_jax.data.indexed import IndexedDataset

    indexed = IndexedDataset(prefix)
    first, stop = split_ranges(data_split, len(indexed))[split] if split else (0, len(indexed))
    if stop <= first:
        fail(f'--data {prefix}: its {split} split (data.split {data_split}) has no documents')
    return np.concatenate([indexed[i] for i in range(first, stop)])


def read_task_data(args, tokenizer, config):
    """The task's input, read and checked before any model is loaded."""
    import numpy as np

    from mtnlg_jax.data.indexed import DataError
    from mtnlg_jax.eval import tasks

    vocab_size = config.model.vocab_size
    indexed = os.path.isfile(args.data + '.idx')
    if not indexed and not os.path.isfile(args.data):
        fail(f'--data {args.data}: no such file (nor {args.data}.idx)')
    if args.split and not (indexed and args.task == 'perplexity'):
        fail('--split takes a split of an indexed dataset, for --task perplexity')
    try:
        if args.task == 'perplexity':
            if indexed:
                if args.count_words:
                    fail('--count_words needs a text file; give --num_words for a token file')
                tokens = indexed_tokens(args.data, args.split, config.data.split)
                num_words = args.num_words
            else:
                with open(args.data, encoding='utf-8') as f:
                    text = f.read()
                tokens = tokenizer().encode(text)
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


def print_table(title, result):
    """A two-column markdown table of the result under its title."""
    rows = [(k, f'{v:.4f}' if isinstance(v, float) else str(v)) for k, v in result.items()]
    width = max(len(key) for key, _ in rows)
    print(f'\n{title}\n\n| {"metric":<{width}} | value |\n|{"-" * (width + 2)}|-------|')
    for key, value in rows:
        print(f'| {key:<{width}} | {value} |')


def main(argv):
    args = parse_args(argv)
    for name in ('batch_size', 'data_parallel', 'tensor', 'limit', 'max_tokens', 'num_words'):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f'--{name} must be a positive integer, got {value}')
    if args.max_tokens and (args.num_words or args.count_words):
        fail('--max_tokens cuts the text, so the word count would not match: drop one of them')

    import jax  # after argument checks: a bad command line costs no JAX start-up

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.eval import tasks
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.eval.scoring import Scorer

    try:
        saved = workdir_lib.read_saved_config(args.workdir)
        config = workdir_lib.inference_config(saved, args.data_parallel, args.tensor)
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))

    def tokenizer():
        try:
            return workdir_lib.open_tokenizer(args.tokenizer or config.data.tokenizer, config.model)
        except workdir_lib.WorkdirError as e:
            fail(str(e))

    task_data, num_words = read_task_data(args, tokenizer, config)
    if num_words is not None and num_words < 2:
        fail(f'word-normalised perplexity needs at least 2 words, got {num_words}')
    if args.task == 'perplexity' and not 0 <= args.overlap < config.model.seq_len:
        fail(f'--overlap must be in [0, seq_len={config.model.seq_len}), got {args.overlap}')
    if args.task == 'multiple_choice' and args.shots >= len(task_data):
        fail(
            f'--shots {args.shots} needs more than {args.shots} items, --data has {len(task_data)}'
        )
    try:
        loaded = workdir_lib.load(args.workdir, args.step, args.data_parallel, args.tensor)
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))
    score = Scorer(loaded, args.batch_size)
    seq_len = loaded.config.model.seq_len
    if args.task == 'perplexity':
        result = tasks.perplexity(score, task_data, seq_len, args.overlap, num_words)
    elif args.task == 'lambada':
        result, _ = tasks.lambada(
            score, tokenizer().encode, [r['text'] for r in task_data], seq_len
        )
    else:
        result, _ = tasks.multiple_choice(
            score, tokenizer().encode, task_data, seq_len, args.shots, args.seed
        )
    mesh = loaded.config.mesh
    record = dict(
        task=args.task,
        workdir=args.workdir,
        step=loaded.step,
        data=args.data,
        mesh=f'data {mesh.data} x tensor {mesh.tensor} on {jax.devices()[0].device_kind}',
        **result,
    )
    print_table(f'{args.task} of {args.workdir} at step {loaded.step}', result)
    output = args.output or os.path.join(
        args.workdir, 'eval', f'{args.task}_step{loaded.step}.json'
    )
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, 'w') as f:
        json.dump(record, f, indent=2)
    print(f'wrote {output}')


if __name__ == '__main__':
    main(sys.argv[1:])
