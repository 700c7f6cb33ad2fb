"""Batch-size ramp-up: the global batch as a function of the samples consumed, as Megatron.

Pure arithmetic on the config's `train.rampup` keys, so it sits at the config's layer: the
config derives optimizer.decay_tokens from it, the loader and the trainer follow it.

MT-NLG started at 32 sequences and added 32 at a time until 1920, over its first 12 B tokens.
`train.rampup` = (start, increment, tokens); the ramp's tokens / seq_len are its samples, and
the batch steps up every (ramp samples / number of increments) samples:

    batch(consumed) = start + increment * floor(consumed / samples per increment)
                      until consumed > ramp samples, then train.global_batch

    global batch  1920 |                         ___________
                       |                    ____|
                       |               ____|
                    32 |______________|  ...  (59 increments of 32 over 12 B tokens)
                       +----------------------------------> samples consumed

Because the batch depends on samples consumed, not on the step, a resumed run (whose
checkpoint holds the count) continues on the same schedule. The number of micro-steps is
batch / (micro_batch x data); the config check makes every stage divisible by that.
"""


def enabled(train_cfg):
    return bool(train_cfg.rampup.start)


def global_batch_at(train_cfg, seq_len, samples_consumed):
    """The global batch of the step that starts after `samples_consumed` samples."""
    if not enabled(train_cfg):
        return train_cfg.global_batch
    ramp = train_cfg.rampup
    ramp_samples = ramp.tokens / seq_len
    if samples_consumed > ramp_samples:
        return train_cfg.global_batch
    increments = (train_cfg.global_batch - ramp.start) // ramp.increment
    per_increment = ramp_samples / increments
    batch = ramp.start + ramp.increment * int(samples_consumed / per_increment)
    return min(batch, train_cfg.global_batch)


def schedule(train_cfg, seq_len, steps, samples_consumed=0):
    """Global batch of each of `steps` steps from `samples_consumed` on."""
    batches = []
    for _ in range(steps):
        batch = global_batch_at(train_cfg, seq_len, samples_consumed)
        if not enabled(train_cfg) or batch == train_cfg.global_batch:
            return batches + [train_cfg.global_batch] * (steps - len(batches))
        batches.append(batch)
        samples_consumed += batch
    return batches


def total_samples(train_cfg, seq_len):
    """Samples of a whole run of train.steps steps, ramp included."""
    return sum(schedule(train_cfg, seq_len, train_cfg.steps))


def stages(train_cfg):
    """The distinct global batches a run may use, smallest first."""
    if not enabled(train_cfg):
        return [train_cfg.global_batch]
    ramp = train_cfg.rampup
    return list(range(ramp.start, train_cfg.global_batch, ramp.increment)) + [
        train_cfg.global_batch
    ]
