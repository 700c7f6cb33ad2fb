"""Where the train state keeps each layer's block parameters when the mesh has stages.

Stored form: block parameters (and their Adam moments) are kept stage-major, so the rule
'layers' -> 'stage' gives each stage exactly its own chunks. p stages, v repeats, chunk
c = r p + s on stage s; every chunk has `slots` places:

    storage index  s (v slots) + r slots + j   holds layer  first_layer(c) + j   (j < n(c))
                                               or nothing, a zero padding slot   (j >= n(c))

Stages of equal depth (L / p layers each): n(c) = slots = L / (p v), no padding. Stages of
unequal depth (`pipeline.first_stage_layers` / `last_stage_layers`, Megatron's
--decoder-first-pipeline-num-layers / --decoder-last-...): stage s holds its n_s layers, n_s / v
per chunk, the other stages share the rest evenly; `slots` is the largest chunk, and the
smaller chunks' last places are padding. Llama 3 405B on 16 stages: 7, 8 x 14, 7 -> 128
places for 126 layers. A padding slot's parameters are zeros; the engine runs its layer and
drops the result (apply_blocks' `used`: a tick lasts as long as the deepest chunk, so skipping
saves no time), so it gets no gradient and stays zero under Adam and weight decay.

The V placement (`pipeline.schedule = 'zbv'`, v = 2, parallel/zero_bubble_v.py) is one more
mapping: stage s holds chunk s and chunk 2p - 1 - s (`chunk_index`), so the forward runs down
the stages and back up, and stage 0 holds the embedding's chunk and the head's. The stored
order above is unchanged but for which chunk sits in (s, r): layer first_layer(c) + j of
c = chunk_index(r, s).

Checkpoints hold the L layers in plain layer order (`to_layer_order` before saving, padding
dropped; `to_schedule_order` after restoring, padding zeros), so any (stage, repeats, first,
last, schedule) restores any other.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtnlg_jax.config import block_stack_layers, stage_layers


def chunk_index(repeat, stage, stages, v_shape=False):
    """The chunk (in the model's order) that stage `stage` runs as its chunk `repeat`:
    repeat p + stage, or in the V (v = 2) stage on the way down and 2p - 1 - stage on the
    way back. Integers or arrays (numpy or traced)."""
    if not v_shape:
        return repeat * stages + stage
    return repeat * stages + stage + repeat * (stages - 1 - 2 * stage)


def stage_of(chunk, stages, v_shape=False):
    """The stage chunk `chunk` runs on (chunk_index's inverse, for ints)."""
    if not v_shape:
        return chunk % stages
    return chunk if chunk < stages else 2 * stages - 1 - chunk


@dataclasses.dataclass(frozen=True)
class StageLayers:
    """How L layers sit on p stages of v chunks; first / last: layers on the first / last
    stage (0: the even share); v_shape: chunks placed in a V (chunk_index)."""

    num_layers: int
    stages: int
    repeats: int = 1
    first: int = 0
    last: int = 0
    v_shape: bool = False

    @functools.cached_property
    def per_stage(self):
        """Layers on each stage (config/stage_layers.py; ValueError naming the rule)."""
        return stage_layers.per_stage(
            self.num_layers, self.stages, self.repeats, self.first, self.last
        )

    @functools.cached_property
    def chunk_sizes(self):
        """(v, p) int: layers in stage s's chunk r (chunk_index(r, s)). A stage's layers
        split as evenly as they go;
        the chunks that hold the embedding (chunk 0 of stage 0) and the head (the last chunk of
        the last stage) are the last to get an extra layer: 405 B interleaved x 2 runs stage 0
        as 3 + 4 layers and stage 15 as 4 + 3."""
        v, layers = self.repeats, np.array(self.per_stage)
        sizes = np.tile(layers // v, (v, 1))
        for s, extra in enumerate(layers % v):
            order = range(v - 1, -1, -1) if s == 0 else range(v)
            for r in list(order)[:extra]:
                sizes[r, s] += 1
        return sizes

    @property
    def slots(self):
        """Places per chunk: the largest chunk's layers."""
        return int(self.chunk_sizes.max())

    @property
    def padded(self):
        return bool((self.chunk_sizes < self.slots).any())

    @property
    def stored_layers(self):
        """Places in the stored block stack: p v slots."""
        return self.stages * self.repeats * self.slots

    @functools.cached_property
    def first_layers(self):
        """(v, p) int: the model's index of the first layer of stage s's chunk r."""
        v, p = self.chunk_sizes.shape
        repeat, stage = np.meshgrid(np.arange(v), np.arange(p), indexing='ij')
        chunk = chunk_index(repeat, stage, p, self.v_shape)
        sizes = np.zeros(v * p, np.int64)
        sizes[chunk] = self.chunk_sizes  # in the model's order
        return (np.cumsum(sizes) - sizes)[chunk]

    def tables(self):
        """(first layers, chunk sizes), each (v, p): what an engine indexes by (repeat,
        stage) to run a chunk."""
        return self.first_layers, self.chunk_sizes

    def storage(self):
        """The layer held at each storage index, -1 for a padding slot."""
        v, p, slots = self.repeats, self.stages, self.slots
        held = np.full((p, v, slots), -1)
        for s in range(p):
            for r in range(v):
                n = self.chunk_sizes[r, s]
                held[s, r, :n] = self.first_layers[r, s] + np.arange(n)
        return held.reshape(-1)


def of_config(config):
    """The StageLayers of a resolved config: of its block stack, the dense layers ahead of a
    mixture of experts left out (the first stage runs them beside the embedding)."""
    pipeline = config.pipeline
    return StageLayers(
        block_stack_layers(config.model),
        config.mesh.stage,
        pipeline.repeats,
        pipeline.get('first_stage_layers', 0),
        pipeline.get('last_stage_layers', 0),
        v_shape=pipeline.get('schedule') == 'zbv' and config.mesh.stage > 1,
    )


def schedule_order(num_layers, stages, repeats, v_shape=False):
    """Layer held at each storage index of the stage-major order (equal stages)."""
    return StageLayers(num_layers, stages, repeats, v_shape=v_shape).storage()


def _map_blocks(tree, fn):
    """fn(leaf) on every leaf under a 'blocks' key (parameters and Adam moments)."""

    def apply(path, leaf):
        in_blocks = any(getattr(key, 'key', None) == 'blocks' for key in path)
        return fn(leaf) if in_blocks else leaf

    return jax.tree_util.tree_map_with_path(apply, tree)


def _as_layout(layout_or_layers, stages=None, repeats=None):
    if isinstance(layout_or_layers, StageLayers):
        return layout_or_layers
    return StageLayers(layout_or_layers, stages, repeats)


def to_schedule_order(tree, num_layers, stages=None, repeats=None):
    """Blocks in layer order (L on axis 0) -> the stored order (padding slots zero).
    num_layers: L, or a StageLayers (then stages and repeats are its own)."""
    layout = _as_layout(num_layers, stages, repeats)
    held = layout.storage()
    if np.array_equal(held, np.arange(len(held))):
        return tree
    keep = held >= 0

    def place(leaf):
        taken = jnp.take(leaf, np.maximum(held, 0), axis=0)
        if keep.all():
            return taken
        mask = keep.reshape(-1, *(1,) * (leaf.ndim - 1))
        return jnp.where(mask, taken, jnp.zeros((), leaf.dtype))

    return _map_blocks(tree, place)


def to_layer_order(tree, num_layers, stages=None, repeats=None):
    """The stored order -> blocks in layer order, padding slots dropped (L on axis 0)."""
    layout = _as_layout(num_layers, stages, repeats)
    held = layout.storage()
    if np.array_equal(held, np.arange(len(held))):
        return tree
    where = np.argsort(np.where(held >= 0, held, len(held)))[: layout.num_layers]
    return _map_blocks(tree, lambda leaf: jnp.take(leaf, where, axis=0))
