"""Unigram and interpolated-bigram cross-entropy of a validation split, next to the model's.

    python bench/baselines.py --data data/default/kjv [--split valid] [--max_tokens 16384]
        [--data_split 969,30,1] [--model_eval runs/tiny/eval/kjv_valid.json]

The counts come from the same indexed dataset's training split (Megatron's document split,
data.split), the scores from the first --max_tokens tokens of --split: the tokens that
`launch/evaluate.py --task perplexity --split valid --max_tokens N` scores, so the rows are
comparable. --model_eval: the JSON evaluate.py wrote; its loss becomes the first row. A model
above the bigram row has learned less than counting word pairs (mtnlg_jax/eval/baselines.py).
"""

import json
import os
import sys

from mtnlg_jax.run.cli import ArgumentParser, fail
from mtnlg_jax.data.gpt_dataset import split_tokens
from mtnlg_jax.data.indexed import DataError, IndexedDataset
from mtnlg_jax.eval import baselines


def parse_args(argv):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--data', required=True, help='indexed dataset prefix (.bin/.idx)')
    parser.add_argument('--split', default='valid', choices=('valid', 'test'))
    parser.add_argument('--data_split', default='969,30,1', help="the run's data.split")
    parser.add_argument('--max_tokens', type=int, default=None, help='score this many tokens')
    parser.add_argument('--vocab_size', type=int, default=None, help='default: max id + 1')
    parser.add_argument('--model_eval', help="evaluate.py's perplexity JSON for this split")
    return parser.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 2:
        fail(f'--max_tokens must be at least 2, got {args.max_tokens}')
    model = None
    if args.model_eval:
        try:
            with open(args.model_eval) as f:
                model = json.load(f)
            model['loss'] = float(model['loss'])
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f'--model_eval {args.model_eval}: not a perplexity result ({e})')
    try:
        indexed = IndexedDataset(args.data)
        train = split_tokens(indexed, 'train', args.data_split)
        evals = split_tokens(indexed, args.split, args.data_split)[: args.max_tokens]
    except (DataError, ValueError) as e:
        fail(f'--data {args.data}: {e}')
    if model and model.get('tokens') not in (None, len(evals)):
        fail(
            f'--model_eval {args.model_eval} scored {model["tokens"]} tokens, these baselines '
            f'{len(evals)}: give the same --max_tokens'
        )
    vocab = args.vocab_size or int(max(train.max(), evals.max())) + 1
    rows = [
        ('unigram (add-one)', baselines.unigram_cross_entropy(train, evals, vocab)),
        (
            f'bigram ({baselines.BIGRAM_WEIGHT} bigram'
            f' + {1 - baselines.BIGRAM_WEIGHT:.1f} unigram)',
            baselines.bigram_cross_entropy(train, evals, vocab),
        ),
    ]
    if model:
        rows.insert(0, (f'GPT at step {model.get("step", "?")}', model['loss']))
    name = os.path.basename(args.data)
    print(
        f'\n{name} {args.split} split: {len(evals) - 1:,} target tokens; counts from its train '
        f'split ({len(train):,} tokens), data.split {args.data_split}'
    )
    print('| model | loss (nats/token) |\n|---|---|')
    for label, loss in rows:
        print(f'| {label} | {loss:.4f} |')
    if model:
        bigram = rows[-1][1]
        verdict = 'below' if model['loss'] < bigram else 'ABOVE'
        print(
            f'the model is {verdict} the bigram baseline by {abs(model["loss"] - bigram):.3f} nats'
        )


if __name__ == '__main__':
    main(sys.argv[1:])
