"""Sharded orbax checkpoints of the train state that restore onto any mesh layout.

    <workdir>/checkpoints/<step>/state   params, optimizer state, step: tensorstore arrays,
                                         each process writing only its own shards
    <workdir>/checkpoints/<step>/meta    JSON: samples consumed, tokens seen, the resolved
                                         config and the tokenizer's identity

The arrays are stored in their logical shapes, whatever the layout that wrote them; restoring
reads them straight into the shardings of the layout that restores (orbax reshards), so a run
saved under (data 4, tensor 2) resumes under (data 2, tensor 4) with no conversion step.
"""

import os

import jax
import orbax.checkpoint as ocp


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs that carry the shardings to restore into."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_tree,
        shardings,
    )


class Checkpoints:
    """The checkpoints of one workdir: save every `every` steps and at the end, keep `keep`."""

    def __init__(self, workdir, keep=3):
        self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints'))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self):
        return self._manager.latest_step()

    def all_steps(self):
        return list(self._manager.all_steps())

    def save(self, step, state, meta):
        """Start writing `state` and `meta` at `step`; training goes on while it writes."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(self, abstract_state, step=None):
        """(state, meta) of `step` (default: the newest), laid out as `abstract_state` says."""
        step = self.latest_step() if step is None else step
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return restored['state'], restored['meta']

    def wait(self):
        """Block until every save in flight is on disk."""
        self._manager.wait_until_finished()

    def close(self):
        self._manager.close()
