"""Packed documents that do not see each other: positions, segment ids and loss mask of a row.

Megatron's `get_ltor_masks_and_position_ids(data, eod, reset_position_ids,
reset_attention_mask, eod_mask_loss)`, the same keys with the same meaning
(`data.reset_position_ids`, `data.reset_attention_mask`, `data.eod_mask_loss`), computed from
the input tokens (the row without its last token) in a few vectorised passes:

    inputs        a  b  c  E  d  e  E  f        E = data.eod_id (the document's last token)
    segment ids   0  0  0  0  1  1  1  2        EODs strictly before: reset_attention_mask
    positions     0  1  2  3  0  1  2  0        restart after each EOD: reset_position_ids
    loss mask     1  1  1  0  1  1  0  1        0 where the input is an EOD: eod_mask_loss

A query sees a key when the key is not later and, with reset_attention_mask, in the same
segment: Megatron's mask `attention_mask[b, 0, i + 1:, :i + 1] = 0` after each EOD at i. The
EOD belongs to the document it ends; the next document, its BOS first where the tokenizer
writes one, starts at position 0 and sees only itself. With eod_mask_loss the prediction made
from an EOD (the next document's first token, its BOS) is left out of the loss, which is the
token-weighted mean of the rest, as Megatron's (sum of loss x mask / sum of mask).

Each array is None when its key is off, so a run without packing compiles the program it
compiled before. The train step makes them on the device from the batch's tokens (a cumulative
sum and a cumulative max along the sequence per row), so the batch on the wire stays the tokens.
"""

import collections

import jax
import jax.numpy as jnp

from mtnlg_jax.config import ConfigError

KEYS = ('reset_position_ids', 'reset_attention_mask', 'eod_mask_loss')

Packed = collections.namedtuple('Packed', 'positions segment_ids loss_mask')
UNPACKED = Packed(None, None, None)


def enabled(data_cfg):
    """Whether any of the three keys is on."""
    return any(bool(data_cfg.get(key, False)) for key in KEYS)


def packed_inputs(inputs, eod_id, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Packed(positions, segment_ids, loss_mask) of input tokens (..., seq); int32 positions
    and segment ids, fp32 loss mask; each None when its key is off."""
    is_eod = inputs == eod_id
    positions = segment_ids = loss_mask = None
    if reset_attention_mask:
        count = jnp.cumsum(is_eod.astype(jnp.int32), axis=-1)
        segment_ids = count - is_eod.astype(jnp.int32)  # EODs strictly before
    if reset_position_ids:
        index = jax.lax.broadcasted_iota(jnp.int32, inputs.shape, inputs.ndim - 1)
        # where each document starts: one past an EOD (shifted right by one along seq)
        starts = jnp.where(is_eod, index + 1, 0)
        starts = jnp.concatenate([jnp.zeros_like(starts[..., :1]), starts[..., :-1]], axis=-1)
        positions = index - jax.lax.cummax(starts, axis=inputs.ndim - 1)
    if eod_mask_loss:
        loss_mask = jnp.where(is_eod, 0.0, 1.0).astype(jnp.float32)
    return Packed(positions, segment_ids, loss_mask)


def of_config(config):
    """packed_inputs(inputs) under config.data's keys, or None when packing is off."""
    data = config.data
    if not enabled(data):
        return None
    flags = [bool(data[key]) for key in KEYS]
    return lambda inputs: packed_inputs(inputs, data.eod_id, *flags)


def resolve_eod_id(config):
    """config with data.eod_id filled from the tokenizer's end-of-document id when packing is
    on and data.eod_id is -1; ConfigError naming data.eod_id when there is none to take."""
    data = config.data
    if not enabled(data) or data.eod_id >= 0:
        return config
    from mtnlg_jax.data import tokenizer as tokenizer_lib

    why = 'data.tokenizer is empty'
    if data.tokenizer:
        try:
            data.eod_id = tokenizer_lib.load(data.tokenizer).eod_id
            return config
        except tokenizer_lib.TokenizerError as e:
            why = str(e)
    raise ConfigError(
        'data.eod_id',
        f'-1 takes the tokenizer\'s end-of-document id for {", ".join(KEYS)}, but {why}: '
        f'set the id',
    )
