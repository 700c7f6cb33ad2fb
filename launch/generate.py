"""Generate text from a workdir's checkpoint, with a KV cache, tensor parallel.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python launch/generate.py \
        --workdir runs/tiny --prompt "In the beginning" --max_new_tokens 40
    ... --prompt "A" --prompt "B" --temperature 0.8 --top_p 0.9      (a batch of prompts)
    ... --prompts_file prompts.txt                                    (one prompt a line)

Greedy by default (--temperature 0); --temperature T with --top_k K and/or --top_p P samples.
Each prompt stops at the end of a document or after --max_new_tokens. With one prompt the text
is streamed as it is produced; with several, each completion prints when the batch is done.
The mesh is data 1 x tensor (the run's tensor size unless --tensor says otherwise); the
completions are also written as JSON with --output. Bad input prints one line `error: ...` and
exits with status 2 before anything is compiled.
"""

import argparse
import json
import os
import sys

from mtnlg_jax.cli import ArgumentParser, fail


def parse_args(argv):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument('--workdir', required=True, help='a run of launch/train.py')
    parser.add_argument('--step', type=int, help='checkpoint step (default: the newest)')
    parser.add_argument('--prompt', action='append', default=[], help='a prompt (repeatable)')
    parser.add_argument('--prompts_file', help='a text file of prompts, one a line')
    parser.add_argument('--max_new_tokens', type=int, default=64)
    parser.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
    parser.add_argument('--top_k', type=int, default=0, help='0: no top-k cut')
    parser.add_argument('--top_p', type=float, default=1.0, help='1: no nucleus cut')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--no_cache', action='store_true', help='recompute (for comparison)')
    parser.add_argument('--tensor', type=int, help="mesh tensor size (default: the run's)")
    parser.add_argument('--data_parallel', type=int, default=1, help='mesh data size')
    parser.add_argument('--tokenizer', help="sentencepiece model (default: the run's)")
    parser.add_argument('--output', help='JSON file of the completions')
    return parser.parse_args(argv)


class Streamer:
    """Prints one row's text as tokens arrive: decoding the whole completion each time, so
    pieces that only make sense together (bytes of one character) print when complete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ''

    def __call__(self, row, token):
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.startswith(self.printed) and not text.endswith('\ufffd'):
            print(text[len(self.printed) :], end='', flush=True)
            self.printed = text


def main(argv):
    args = parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            fail(f'--prompts_file {args.prompts_file}: no such file')
        with open(args.prompts_file, encoding='utf-8') as f:
            prompts += [line.rstrip('\n') for line in f if line.strip()]
    if not prompts or not all(prompts):
        fail('give one or more non-empty --prompt TEXT (or --prompts_file FILE)')
    if args.max_new_tokens < 1:
        fail(f'--max_new_tokens must be a positive integer, got {args.max_new_tokens}')

    from mtnlg_jax import config as config_lib
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.eval.generation import Generator, Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    try:
        sampling.check()
        saved = workdir_lib.read_saved_config(args.workdir)
        config = workdir_lib.inference_config(saved, args.data_parallel, args.tensor)
    except (ValueError, workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))
    try:
        tokenizer = workdir_lib.open_tokenizer(
            args.tokenizer or config.data.tokenizer, config.model
        )
    except workdir_lib.WorkdirError as e:
        fail(str(e))
    encoded = [tokenizer.encode(p) for p in prompts]
    longest = max(len(e) for e in encoded)
    if longest >= config.model.seq_len:
        fail(f'a prompt of {longest} tokens leaves no room in seq_len={config.model.seq_len}')
    try:
        loaded = workdir_lib.load(args.workdir, args.step, args.data_parallel, args.tensor)
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))

    generate = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    stream = Streamer(tokenizer) if len(prompts) == 1 else None
    if stream:
        print(prompts[0], end='', flush=True)
    outputs = generate(
        encoded,
        args.max_new_tokens,
        sampling,
        seed=args.seed,
        eod_id=tokenizer.eod_id,
        use_cache=not args.no_cache,
        on_tokens=stream,
    )
    completions = [tokenizer.decode(tokens) for tokens in outputs]
    if stream:
        print(completions[0][len(stream.printed) :])
    else:
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            print(f'[{i}] {prompt}{completion}')
    if args.output:
        with open(args.output, 'w') as f:
            records = [
                dict(prompt=p, completion=c, tokens=t)
                for p, c, t in zip(prompts, completions, outputs)
            ]
            json.dump(
                dict(workdir=args.workdir, step=loaded.step, completions=records), f, indent=2
            )


if __name__ == '__main__':
    main(sys.argv[1:])
