"""Generate text from a workdir's checkpoint, with a KV cache, tensor parallel, with Hugging
Face's generation options.

    python launch/generate.py --workdir runs/tiny --prompt "In the beginning" --max_new_tokens 40
    ... --prompt "A" --prompt "B" --do_sample --temperature 0.8 --top_p 0.9   (a batch)
    ... --prompts_file prompts.txt                                    (one prompt a line)
    ... --repetition_penalty 1.3 --stop $'\\n\\n' --num_return_sequences 4 --do_sample

Greedy unless --do_sample (then --temperature, --top_k, --top_p; as Hugging Face's generate,
whose names these are). --repetition_penalty P (CTRL's, 1: none) divides the positive logits
and multiplies the negative ones of every token already in the sequence. A sequence stops at
the end of a document, after --max_new_tokens, or once its text contains a --stop string (the
completion is cut before it). A prompt plus --max_new_tokens beyond the model's context window
(seq_len) is an error, not a silent cut. With one prompt and one sequence the text is streamed
as it is produced; otherwise each completion prints when the batch is done. The mesh is data 1
x tensor (the run's tensor size unless --tensor says otherwise; on a CPU-only machine the tool
makes that many CPU devices itself); with --context C, data x context x tensor, the prompts'
prefill split over C devices as training splits a sequence (eval/generation.py); only the
parameters are read. --output writes the completions as JSON with the sampling settings that
made them. Bad input prints one line `error: ...` and exits with status 2 before anything is
compiled or written.
"""

import os
import sys

from mtnlg_jax.run import distributed
from mtnlg_jax.run.cli import (
    ArgumentParser,
    check_output_file,
    cpu_devices,
    fail,
    workdir_config,
    write_json,
)


def parse_args(argv):
    parser = ArgumentParser(description=__doc__)
    parser.add_argument('--workdir', required=True, help='a run of launch/train.py')
    parser.add_argument('--step', type=int, help='checkpoint step (default: the newest)')
    parser.add_argument('--prompt', action='append', default=[], help='a prompt (repeatable)')
    parser.add_argument('--prompts_file', help='a text file of prompts, one a line')
    parser.add_argument('--max_new_tokens', type=int, default=64)
    parser.add_argument('--do_sample', action='store_true', help='sample (default: greedy)')
    parser.add_argument('--temperature', type=float, help='with --do_sample (default 1)')
    parser.add_argument('--top_k', type=int, help='with --do_sample (default 0: no cut)')
    parser.add_argument('--top_p', type=float, help='with --do_sample (default 1: no cut)')
    parser.add_argument('--repetition_penalty', type=float, default=1.0, help='1: none')
    parser.add_argument('--num_return_sequences', type=int, default=1, help='per prompt')
    parser.add_argument('--stop', action='append', default=[], help='stop string (repeatable)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--no_cache', action='store_true', help='recompute (for comparison)')
    parser.add_argument('--tensor', type=int, help="mesh tensor size (default: the run's)")
    parser.add_argument('--data_parallel', type=int, default=1, help='mesh data size')
    parser.add_argument(
        '--expert',
        type=int,
        default=1,
        help="mesh expert size: an MoE's experts split over it, the batch too (default 1)",
    )
    parser.add_argument(
        '--context', type=int, default=1, help="mesh context size: the prompts' prefill split"
    )
    parser.add_argument(
        '--tokenizer', help="sentencepiece .model or GPT-2 BPE files (default: the run's)"
    )
    parser.add_argument('--output', help='JSON file of the completions')
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


class Streamer:
    """Prints one row's text as tokens arrive: decoding the whole completion each time, so
    pieces that only make sense together (bytes of one character) print when complete. The
    last len(longest stop string) - 1 characters wait for the next token: a stop string
    completed by it is then never printed."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ''
        self.hold = max(map(len, stop), default=1) - 1

    def __call__(self, row, token):
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith('\ufffd'):
            return
        text = text[: len(text) - self.hold]
        if text.startswith(self.printed) and len(text) > len(self.printed):
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
    if not args.do_sample:
        for flag in ('temperature', 'top_k', 'top_p'):
            if getattr(args, flag) is not None:
                fail(f'--{flag} shapes sampling: add --do_sample (generation is greedy without)')
    if args.max_new_tokens < 1:
        fail(f'--max_new_tokens must be a positive integer, got {args.max_new_tokens}')
    for name in ('data_parallel', 'expert', 'context', 'tensor'):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f'--{name} must be a positive integer, got {value}')
    if args.output:
        check_output_file(args.output)
    run_mesh = workdir_config(args.workdir)['mesh']
    devices = args.data_parallel * args.expert * args.context * (args.tensor or run_mesh['tensor'])
    cpu_devices(max(1, devices // distributed.requested_process_count(args)))

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # first
    from mtnlg_jax import config as config_lib
    from mtnlg_jax.eval import completion
    from mtnlg_jax.eval import workdir as workdir_lib
    from mtnlg_jax.eval.generation import Generator

    settings = completion.Settings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k or 0,
        top_p=1.0 if args.top_p is None else args.top_p,
        repetition_penalty=args.repetition_penalty,
        num_return_sequences=args.num_return_sequences,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    try:
        settings.check()
    except ValueError as e:  # "temperature must be ...": the flag's name without dashes
        fail(f'--{e}')
    try:
        saved = workdir_lib.read_saved_config(args.workdir)
        config = workdir_lib.inference_config(
            saved, args.data_parallel, args.tensor, args.context, args.expert
        )
        tokenizer, _ = workdir_lib.run_tokenizer(args.workdir, config, args.tokenizer)
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))
    try:
        longest = max(len(tokenizer.encode_prompt(p)) for p in prompts)
        settings.check_fits(longest, config.model.seq_len)
    except ValueError as e:  # "max_new_tokens 30: a prompt of ...": the flag's name
        fail(f'--{e}')
    try:
        loaded = workdir_lib.load(
            args.workdir,
            args.step,
            args.data_parallel,
            args.tensor,
            context=args.context,
            expert=args.expert,
        )
    except (workdir_lib.WorkdirError, config_lib.ConfigError) as e:
        fail(str(e))

    generate = Generator(loaded.graphdef, loaded.params, loaded.config.model, loaded.mesh)
    primary = distributed.is_primary()  # prints and writes; every process computes
    stream = None
    if len(prompts) == 1 and settings.num_return_sequences == 1 and primary:
        stream = Streamer(tokenizer, settings.stop)
        print(prompts[0], end='', flush=True)
    completions = completion.complete(
        generate, tokenizer, prompts, settings, use_cache=not args.no_cache, on_tokens=stream
    )
    if not primary:
        return
    if stream:
        print(completions[0][0].text[len(stream.printed) :])
    else:
        for i, (prompt, sequences) in enumerate(zip(prompts, completions)):
            for j, sequence in enumerate(sequences):
                label = f'{i}' if len(sequences) == 1 else f'{i}.{j}'
                print(f'[{label}] {prompt}{sequence.text}')
    if args.output:
        records = [
            dict(prompt=prompt, sequence=j, completion=sequence.text, tokens=sequence.tokens)
            for prompt, sequences in zip(prompts, completions)
            for j, sequence in enumerate(sequences)
        ]
        result = dict(
            workdir=os.path.abspath(args.workdir),
            step=loaded.step,
            settings=dict(settings.to_dict(), use_cache=not args.no_cache),
            completions=records,
        )
        write_json(args.output, result)


if __name__ == '__main__':
    main(sys.argv[1:])
