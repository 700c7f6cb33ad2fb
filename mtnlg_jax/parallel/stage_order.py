"""Where the train state keeps each layer's block parameters when the mesh has stages.

Stored form: block parameters (and their Adam moments) are kept stage-major, so the rule
'layers' -> 'stage' gives each stage exactly its own chunks:

    storage index  s (v L/(pv)) + r L/(pv) + j   holds layer  (r p + s) L/(pv) + j

Checkpoints hold them in plain layer order (`to_layer_order` before saving,
`to_schedule_order` after restoring), so any (stage, repeats, schedule) restores any other.
"""

import jax
import jax.numpy as jnp
import numpy as np


def schedule_order(num_layers, stages, repeats):
    """Layer held at each storage index of the stage-major order."""
    per_chunk = num_layers // (stages * repeats)
    return np.array(
        [
            (r * stages + s) * per_chunk + j
            for s in range(stages)
            for r in range(repeats)
            for j in range(per_chunk)
        ]
    )


def _reorder_blocks(tree, index):
    """Permute axis 0 of every leaf under a 'blocks' key (parameters and Adam moments)."""
    if np.array_equal(index, np.arange(len(index))):
        return tree

    def reorder(path, leaf):
        in_blocks = any(getattr(key, 'key', None) == 'blocks' for key in path)
        return jnp.take(leaf, index, axis=0) if in_blocks else leaf

    return jax.tree_util.tree_map_with_path(reorder, tree)


def to_schedule_order(tree, num_layers, stages, repeats):
    return _reorder_blocks(tree, schedule_order(num_layers, stages, repeats))


def to_layer_order(tree, num_layers, stages, repeats):
    return _reorder_blocks(tree, np.argsort(schedule_order(num_layers, stages, repeats)))
