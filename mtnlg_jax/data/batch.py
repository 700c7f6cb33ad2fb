"""How a global batch is laid out on the mesh: (micro_steps, rows, seq + 1), rows over the
replica axes (the rule table's `batch` row: rules.REPLICA_AXES, 'data' and 'expert').

    global batch (B, seq + 1)  --reshape-->  (M, B / M, seq + 1)    M = micro-steps
    row ids      (M, B / M):   each sequence's index in the global batch, 0 .. B - 1
                               (its dropout key depends on it alone, not on the layout)

The train step (train/step.py) and the loader (data/loader.py) both use these, so they live
with the data: the loader never imports the trainer.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding

from mtnlg_jax.parallel import rules

BATCH_AXES = ('micro_steps', 'batch', 'window')


def micro_step_row_ids(global_batch, micro_steps):
    """(micro_steps, global_batch / micro_steps): each sequence's index in the global batch
    (its dropout key depends on it alone)."""
    return np.arange(global_batch, dtype=np.int32).reshape(micro_steps, -1)


def place_row_ids(row_ids, mesh):
    """Row ids on the mesh, laid out as the tokens' first two axes."""
    sharding = NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES[:2]))
    return jax.make_array_from_callback(row_ids.shape, sharding, lambda i: row_ids[i])


def to_micro_steps(global_batch, micro_steps):
    """(global_batch, seq + 1) -> (micro_steps, global_batch / micro_steps, seq + 1) and the
    row ids of micro_step_row_ids."""
    rows = global_batch.shape[0]
    tokens = global_batch.reshape(micro_steps, rows // micro_steps, -1)
    return tokens, micro_step_row_ids(rows, micro_steps)


def place_batch(tokens, row_ids, mesh):
    """Put a host batch held whole in memory on the mesh; each device receives only its own
    rows (the training loop reads datasets per process instead: data/loader.py)."""
    token_sharding = NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES))
    tokens = jax.make_array_from_callback(tokens.shape, token_sharding, lambda i: tokens[i])
    return tokens, place_row_ids(row_ids, mesh)
