"""Moved to mtnlg_jax/data/rampup.py (the batch schedule belongs to the data); this name is
kept so that code written against the old place still imports."""

from mtnlg_jax.data.rampup import (  # noqa: F401
    enabled,
    global_batch_at,
    schedule,
    stages,
    total_samples,
)
