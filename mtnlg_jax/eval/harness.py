"""lm-evaluation-harness's model class for a workdir: `--model mtnlg_jax` (launch/harness.py).

    lm_eval.simple_evaluate(model='mtnlg_jax', model_args='workdir=runs/tiny,tensor=2', ...)
    (or an instance: simple_evaluate(model=HarnessModel('runs/tiny'), ...))

model_args: workdir, step (default: the newest checkpoint), data and tensor (the inference
mesh, default the run's), tokenizer (default the run's data.tokenizer), batch_size (rows per
model call, default 8), max_gen_toks (default 256).

The three request types run on this project's own inference paths, on any data x tensor mesh:

    loglikelihood          scoring.Scorer over (context, continuation) rows: the summed
                           log-probability and whether every continuation token is the argmax,
                           reductions over the vocabulary shards (no device gathers logits)
    loglikelihood_rolling  the harness's own disjoint windows of seq_len tokens (the first one
                           after the eod token), scored the same way and summed
    generate_until         completion.complete_tokens: the KV-cache Generator, batched by
                           batch_size, with `until` as stop strings and the harness's
                           do_sample / temperature / top_k / top_p / repetition_penalty

Contexts and continuations are tokenized by the harness's rule (TemplateLM._encode_pair, the
same as tasks.encode_pair). A generation request keeps the last seq_len - max_gen_toks tokens
of its context, as the harness's Hugging Face model does; max_gen_toks is capped to leave one.
One process: every request runs on every device of the mesh (rank 0 of world size 1).
"""

import logging

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from mtnlg_jax.eval import completion
from mtnlg_jax.eval import workdir as workdir_lib
from mtnlg_jax.eval.generation import Generator
from mtnlg_jax.eval.scoring import Scorer, continuation_row

log = logging.getLogger(__name__)
SAMPLING_KEYS = ('do_sample', 'temperature', 'top_k', 'top_p', 'repetition_penalty', 'seed')


def _optional_int(value):
    return None if value in (None, '', 'None') else int(value)


@register_model('mtnlg_jax')
class HarnessModel(TemplateLM):
    def __init__(
        self,
        workdir,
        step=None,
        data=None,
        tensor=None,
        expert=None,
        tokenizer=None,
        batch_size=8,
        max_gen_toks=256,
        **unused,
    ):
        """Arguments as model_args spells them (strings); batch_size also from the harness's
        --batch_size (a number; 'auto' keeps 8)."""
        super().__init__()
        batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        step, data, tensor = map(_optional_int, (step, data, tensor))
        expert = _optional_int(expert) or 1
        saved = workdir_lib.read_saved_config(workdir)
        config = workdir_lib.inference_config(saved, data, tensor, expert=expert)
        self.tokenizer, _ = workdir_lib.run_tokenizer(workdir, config, tokenizer)
        self.loaded = workdir_lib.load(workdir, step, data, tensor, expert=expert)
        self.batch_size = int(batch_size)
        self.seq_len = self.loaded.config.model.seq_len
        self.max_gen_toks = int(max_gen_toks)
        self.scorer = Scorer(self.loaded, self.batch_size, progress=False)
        model = self.loaded
        self.generator = Generator(
            model.graphdef, model.params, model.config.model, model.mesh, shape_bucket=64
        )
        unused = {key for key, value in unused.items() if value is not None}
        if unused - {'max_batch_size', 'device'}:
            log.warning('mtnlg_jax ignores model_args %s', sorted(unused))

    # ------------------------------------------------------------------ tokenizer interface
    @property
    def eot_token_id(self):
        return self.tokenizer.eod_id

    @property
    def max_length(self):
        return self.seq_len

    @property
    def tokenizer_name(self):
        return f'{self.tokenizer.kind}-{self.tokenizer.identity[:16]}'

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens, **kwargs):
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------------ the requests
    def _score(self, rows, disable_tqdm, description):
        """(log_prob_sum, all_argmax) per row, in batches, with the harness's progress bar."""
        log_prob, greedy = [], []
        step = self.scorer.batch_size
        for start in tqdm(range(0, len(rows), step), desc=description, disable=disable_tqdm):
            lp, argmax, _ = self.scorer(rows[start : start + step])
            log_prob += lp.tolist()
            greedy += argmax.tolist()
        return log_prob, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        rows = [
            continuation_row(context, continuation, self.seq_len)
            for _, context, continuation in requests
        ]
        log_prob, greedy = self._score(rows, disable_tqdm, 'loglikelihood')
        results = []
        for (key, _, _), lp, is_greedy in zip(requests, log_prob, greedy):
            result = (float(lp), bool(is_greedy))
            self.cache_hook.add_partial('loglikelihood', key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        rows, owners = [], []
        for index, request in enumerate(requests):
            windows = get_rolling_token_windows(
                self.tok_encode(request.args[0]), self.eot_token_id, self.seq_len, 1
            )
            for context, continuation in map(make_disjoint_window, windows):
                rows.append(continuation_row(context, continuation, self.seq_len))
                owners.append(index)
        log_prob, _ = self._score(rows, disable_tqdm, 'loglikelihood_rolling')
        totals = [0.0] * len(requests)
        for owner, lp in zip(owners, log_prob):
            totals[owner] += lp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial('loglikelihood_rolling', request.args, total)
        return totals

    def settings_of(self, gen_kwargs):
        """completion.Settings of a request's generation kwargs (the harness's names)."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop('until', None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = min(int(kwargs.pop('max_gen_toks', self.max_gen_toks)), self.seq_len - 1)
        sampling = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}
        if sampling.get('temperature') == 0:  # the harness's way of asking for greedy
            sampling['do_sample'] = False
        if kwargs:
            log.info('mtnlg_jax ignores generation kwargs %s', sorted(kwargs))
        stop = tuple(s for s in until if s)  # the eod token decodes to '' and stops anyway
        return completion.Settings(max_new_tokens=max_new, stop=stop, **sampling)

    def generate_until(self, requests, disable_tqdm=False):
        """Completions in request order; requests of equal settings are batched, longest
        first, batch_size at a time."""
        results = [None] * len(requests)
        groups = {}
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            settings = self.settings_of(gen_kwargs)
            keep = self.seq_len - settings.max_new_tokens
            tokens = self.tok_encode(context)[-keep:] or [self.eot_token_id]
            groups.setdefault(settings, []).append((index, tokens))
        progress = tqdm(total=len(requests), desc='generate_until', disable=disable_tqdm)
        for settings, members in groups.items():
            members.sort(key=lambda member: -len(member[1]))
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                outputs = completion.complete_tokens(
                    self.generator, self.tokenizer, [tokens for _, tokens in batch], settings
                )
                for (index, _), sequences in zip(batch, outputs):
                    results[index] = sequences[0].text
                    request = requests[index]
                    self.cache_hook.add_partial('generate_until', request.args, results[index])
                progress.update(len(batch))
        progress.close()
        return results
