"""The CPU train step against what a user would otherwise run: HF GPT-2 + torch AdamW.

    python bench/cpu_peer.py [--config configs/tiny.py] [--rounds 5] [--steps 3]
                             [--micro_steps 1]

Both train the same shape (the config's layers, hidden, heads, seq_len, vocabulary; its
global batch, in --micro_steps accumulated micro-batches: ours inside its jitted step, the
peer by calling backward once per micro-batch; fp32; no dropout) with the same optimizer
recipe (AdamW, the config's betas, weight decay and clipping) on the same cores, interleaved:
each round times --steps steps of ours, then --steps of the peer, so a load that comes and
goes touches both.
Rows: our step on one device; the peer (skipped with a message when torch or transformers is
not installed: `pip install torch transformers`); and the config's own 8-device layout (what
`make train` runs), which shows what simulating 8 devices on these cores costs. Median of all
timed steps after one warm-up each.
"""

import statistics
import time

from common import CompiledStep, layout_config, own_layout_config, print_table

from mtnlg_jax import config as config_lib
from mtnlg_jax.run.cli import ArgumentParser, fail


class OurStep:
    def __init__(self, config):
        self.step = CompiledStep(config)

    def run(self, steps):
        return self.step.step_times(steps, warmup=0)


class TorchPeer:
    """Hugging Face GPT2LMHeadModel + torch.optim.AdamW on the config's shape."""

    def __init__(self, config, micro_steps):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        m, opt = config.model, config.optimizer
        torch.manual_seed(0)
        self.torch = torch
        self.model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=m.padded_vocab,
                n_positions=m.seq_len,
                n_embd=m.hidden,
                n_layer=m.num_layers,
                n_head=m.heads,
                n_inner=m.ffn_hidden,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=(opt.b1, opt.b2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.clip = opt.clip_norm
        shape = (config.train.global_batch, m.seq_len + 1)
        self.tokens = torch.randint(0, m.vocab_size, shape)
        self.micro_steps = micro_steps

    def run(self, steps):
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for inputs in self.tokens[:, :-1].chunk(self.micro_steps):
                loss = self.model(input_ids=inputs, labels=inputs).loss / self.micro_steps
                loss.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()
            times.append(time.perf_counter() - start)
        return times


def make_peer(config, micro_steps):
    try:
        return TorchPeer(config, micro_steps)
    except ImportError as e:
        print(f'peer skipped: {e} (pip install torch transformers to compare)')
        return None


def main():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/tiny.py')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--micro_steps', type=int, default=1)
    args = parser.parse_args()
    global_batch = config_lib.load(args.config).train.global_batch
    if args.micro_steps < 1 or global_batch % args.micro_steps:
        fail(f'--micro_steps {args.micro_steps} must divide the global batch of {global_batch}')

    one_device = layout_config(args.config, 1, 1, 1, args.micro_steps, **{'model.remat': 'none'})
    own = own_layout_config(args.config)
    runners = {
        'ours, 1 device': OurStep(one_device),
        'HF GPT-2 + torch AdamW': make_peer(one_device, args.micro_steps),
        'ours, the config layout': OurStep(own),
    }
    runners = {name: r for name, r in runners.items() if r is not None}
    times = {name: [] for name in runners}
    for name, runner in runners.items():
        runner.run(1)  # warm-up
    for _ in range(args.rounds):
        for name, runner in runners.items():
            times[name] += runner.run(args.steps)

    tokens = one_device.train.global_batch * one_device.model.seq_len
    base = statistics.median(times['ours, 1 device'])
    rows = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        config = own if name.endswith('layout') else one_device
        mesh = config.mesh
        rows.append(
            (
                name,
                f'{mesh.data} x {mesh.stage} x {mesh.tensor}',
                config.train.micro_steps,
                config.model.remat,
                f'{median:.3f}',
                f'{tokens / median:,.0f}',
                f'{base / median:.2f}',
            )
        )
    header = (
        'step',
        'data x stage x tensor',
        'micro-batches',
        'remat',
        'step s',
        'tokens/s',
        'speed vs ours',
    )
    print_table(f'CPU train step of {args.config}, global batch {tokens:,} tokens', header, rows)


if __name__ == '__main__':
    main()
