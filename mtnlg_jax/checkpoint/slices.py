"""A checkpoint's parameters read on the host a layer at a time, without devices: what exporting
a model larger than one host's accelerators needs (launch/convert.py --export_hf). Llama 3
405B's fp32 parameters are 1.6 TB; one layer of its largest stacked leaf is 3.5 GB.

    read = LayerReader(step_dir)                   # a checkpoint the trainer wrote
    read(('blocks', 'mlp', 'in_kernel'), 7)        # layer 7 of a stacked leaf, as numpy
    read(('token_embed',))                         # a whole top-level leaf
    LayerReader(step_dir, 'buffers')(('blocks', 'moe', 'router_bias'))   # a buffer

Orbax builds each stored array's TensorStore spec (the spec its own restore opens: OCDBT,
zarr), and TensorStore reads just the slice asked for, touching only the chunks that hold it
(a chunk is one device's shard as saved). Orbax's restore reads whole leaves, onto devices.
The checkpoint's stacked blocks are in layer order whatever the run's pipeline layout.
"""

import json
import os

import numpy as np


class LayerReader:
    """read(path, layer=None): the parameter at `path` (a tuple of keys under `section`,
    'params' or 'buffers') of the checkpoint in `step_dir`, its layer `layer` only if given,
    as a numpy array."""

    def __init__(self, step_dir, section='params'):
        self.state = os.path.join(os.path.abspath(step_dir), 'state')
        self.section = section
        with open(os.path.join(self.state, '_METADATA')) as f:
            metadata = json.load(f)  # how orbax stored the arrays
        self.ocdbt = metadata.get('use_ocdbt', True)
        self.zarr3 = metadata.get('use_zarr3', False)
        self._arrays, self._context = {}, None

    def __call__(self, path, layer=None):
        array = self._open(tuple(path))
        return np.asarray((array if layer is None else array[layer]).read().result())

    def _open(self, path):
        if path not in self._arrays:
            import orbax.checkpoint as ocp  # noqa: PLC0415 (heavy; only an export needs it)
            import tensorstore as ts  # noqa: PLC0415 (orbax's own dependency)
            from etils import epath  # noqa: PLC0415 (orbax's path type)

            if self._context is None:  # one for every array: OCDBT's caches shared
                self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self.ocdbt)
            info = ocp.type_handlers.ParamInfo(
                name='.'.join((self.section, *path)),
                parent_dir=epath.Path(self.state),
                is_ocdbt_checkpoint=self.ocdbt,
                use_zarr3=self.zarr3,
                ts_context=self._context,
            )
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.ocdbt)
            opened = ts.open(spec, open=True, read=True, context=self._context)
            self._arrays[path] = opened.result()
        return self._arrays[path]
