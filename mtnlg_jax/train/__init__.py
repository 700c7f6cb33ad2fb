"""Training: the state, the step, the loop and what watches it.

state.py       the train state and its shardings
optimizer.py   AdamW, the learning-rate schedule, clipping
step.py        the train and eval steps: accumulation, the ZeRO-1 update
loop.py        the training loop
periodic.py    what runs on a cadence: checkpoints, evaluation
banner.py      what will run and what it costs, printed at the start
reporter.py    progress, metrics, throughput
metrics.py     metrics.jsonl, tensorboard, the loss PNG
resume.py      where a run starts (fresh, continued, restored)
faults.py      signals, skipped steps, loss spikes
watchdog.py    stalled processes
profile.py     a jax.profiler trace of steps, on request
pgle.py        the step compiled again, scheduled by the traced steps' costs (XLA:GPU)
stragglers.py  the slow process named: each measures its own speed, the processes compare
"""
