"""From the config to batches on the mesh: the blended splits, and the global batch of each step.

    data.sources: (weight, prefix) ...   each prefix.bin/.idx, split by data.split
        -> one GPTDataset per source and split -> BlendedDataset per split (train, valid)
        (data.order = megatron: Megatron-LM's own index and blend instead, megatron_order.py)

    step with `consumed` samples behind it:
        B = rampup.global_batch_at(consumed),  M = B / (micro_batch x data) micro-steps
        global batch = blend samples consumed .. consumed + B - 1, laid out (M, B / M, seq + 1)
                       row-major: micro-step m, row r is sample consumed + m * B / M + r
        this process reads only the rows on its addressable devices' shards
        -> jax.make_array_from_callback(..) hands each device its block

So the batch of every step is a pure function of the seed and the samples consumed (invariant 1
of docs/design.md): the mesh, the process count and the micro-step split only decide who reads which
rows. A checkpoint that stores the samples consumed resumes the exact sequence. A background
thread reads and places the next batches while the current step runs.
"""

import collections
import queue
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding

from mtnlg_jax.data import identity, megatron_order
from mtnlg_jax.data.blend import BlendedDataset
from mtnlg_jax.data.gpt_dataset import GPTDataset, split_ranges
from mtnlg_jax.data.indexed import DataError, IndexedDataset
from mtnlg_jax.parallel import rules
from mtnlg_jax import config as config_lib
from mtnlg_jax.config import rampup
from mtnlg_jax.data.batch import BATCH_AXES, micro_step_row_ids, place_row_ids

# Token ids are checked against the vocabulary on this many leading tokens of each source: a
# mismatched tokenizer shows at once, and opening a 300 B token corpus stays instant.
VOCAB_CHECK_TOKENS = 1 << 24

Batch = collections.namedtuple('Batch', 'samples_consumed global_batch micro_steps tokens row_ids')


def open_datasets(config):
    """{'train': blend, 'valid': blend} of config.data (data.order = megatron: and 'test', if
    data.split gives it a share); DataError naming the file if unusable or made by another
    tokenizer (identity.check_sources)."""
    weights = [weight for weight, _ in config.data.sources]
    indexed_sources = [(weight, IndexedDataset(prefix)) for weight, prefix in config.data.sources]
    identity.check_sources(config)  # before the ids: a tokenizer mismatch names both
    for (_, prefix), (_, indexed) in zip(config.data.sources, indexed_sources):
        check_vocabulary(config, prefix, indexed)
    if config.data.order == 'megatron':
        total = rampup.total_samples(config.train, config.model.seq_len)
        return megatron_order.open_splits(
            indexed_sources,
            config.data.split,
            config.model.seq_len,
            config.train.seed,
            megatron_order.split_sizes(config, total),
        )
    splits = {'train': [], 'valid': []}
    for _, indexed in indexed_sources:
        ranges = split_ranges(config.data.split, len(indexed))
        for name, datasets in splits.items():
            datasets.append(
                GPTDataset(indexed, ranges[name], config.model.seq_len, config.train.seed, name)
            )
    return {name: BlendedDataset(datasets, weights) for name, datasets in splits.items()}


def check_vocabulary(config, prefix, indexed):
    """DataError unless the leading token ids of `indexed` fit the model's vocabulary."""
    head = indexed.tokens[:VOCAB_CHECK_TOKENS]
    if len(head) and int(head.max()) >= config.model.vocab_size:
        raise DataError(
            f'{prefix}.bin holds token id {int(head.max())}, but '
            f'model.vocab_size={config.model.vocab_size}'
        )


def rows_of(index, leading_shape):
    """Global sample rows (row-major over the leading dims) of one shard's index."""
    ranges = [np.arange(size)[part] for size, part in zip(leading_shape, index)]
    return np.ravel_multi_index(np.ix_(*ranges), leading_shape)


def process_rows(
    sharding, shape, process_index, device_process=lambda device: device.process_index
):
    """Sorted rows of a (..., seq + 1) array that `process_index`'s devices hold."""
    blocks = [
        rows_of(index, shape[:-1]).ravel()
        for device, index in sharding.devices_indices_map(shape).items()
        if device_process(device) == process_index
    ]
    return np.unique(np.concatenate(blocks)) if blocks else np.zeros(0, np.int64)


def place_rows(read, shape, sharding):
    """A global (..., seq + 1) array whose row k is read([k])[0]; this process reads only its
    own rows, once, however many of its devices hold them."""
    rows = process_rows(sharding, shape, jax.process_index())
    local = read(rows)
    position = np.zeros(int(np.prod(shape[:-1])), np.int64)
    position[rows] = np.arange(len(rows))

    def block(index):
        return local[position[rows_of(index, shape[:-1])]][..., index[-1]]

    return jax.make_array_from_callback(shape, sharding, block)


def place_train_batch(dataset, mesh, samples_consumed, global_batch, micro_steps):
    """The global batch after `samples_consumed`: tokens (M, B / M, seq + 1) and row ids."""
    rows = global_batch // micro_steps
    shape = (micro_steps, rows, dataset.seq_len + 1)
    tokens = place_rows(
        lambda k: dataset.read(samples_consumed + k),
        shape,
        NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES)),
    )
    return tokens, place_row_ids(micro_step_row_ids(global_batch, micro_steps), mesh)


def abstract_train_batch(config, mesh, micro_steps):
    """Shapes and shardings of a train batch with `micro_steps` (for compiling ahead of time)."""
    rows = config.train.micro_batch * config_lib.replicas(config.mesh)
    tokens_shape = (micro_steps, rows, config.model.seq_len + 1)
    return (
        jax.ShapeDtypeStruct(
            tokens_shape, np.int32, sharding=NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES))
        ),
        jax.ShapeDtypeStruct(
            tokens_shape[:2],
            np.int32,
            sharding=NamedSharding(mesh, rules.logical_to_spec(BATCH_AXES[:2])),
        ),
    )


class TrainBatches:
    """The run's batches from `samples_consumed` on, read and placed ahead by a thread.

    next(batches) -> Batch(samples_consumed, global_batch, micro_steps, tokens, row_ids);
    the batch size follows train.rampup. Errors of the reader surface in next()."""

    def __init__(self, config, dataset, mesh, samples_consumed, prefetch=2):
        self._config, self._dataset, self._mesh = config, dataset, mesh
        self._queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(samples_consumed,), name='batches', daemon=True
        )
        self._thread.start()

    def reopened_at(self, samples_consumed):
        """A reader of the same data from another position; this one is closed."""
        self.close()
        return TrainBatches(self._config, self._dataset, self._mesh, samples_consumed)

    def batch_at(self, samples_consumed):
        train_cfg = self._config.train
        global_batch = rampup.global_batch_at(
            train_cfg, self._config.model.seq_len, samples_consumed
        )
        micro_steps = global_batch // (
            train_cfg.micro_batch * config_lib.replicas(self._config.mesh)
        )
        tokens, row_ids = place_train_batch(
            self._dataset, self._mesh, samples_consumed, global_batch, micro_steps
        )
        return Batch(samples_consumed, global_batch, micro_steps, tokens, row_ids)

    def _produce(self, samples_consumed):
        try:
            while not self._stop.is_set():
                batch = self.batch_at(samples_consumed)
                self._put(batch)
                samples_consumed += batch.global_batch
        except Exception as error:  # handed to the consumer, raised by next()
            self._put(error)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self):
        self._stop.set()
        self._thread.join()
