"""The config a workdir was made with (its config.json's inputs), to continue it.

For a workdir that launch/convert.py imported from Hugging Face, or any earlier run:

    python launch/train.py --config configs/workdir.py:runs/gpt2 --workdir runs/gpt2 \
        --config.data.sources='((1.0, PREFIX),)' --config.train.steps=N [--config.mesh.tensor=2 ...]

The keys come back as the run was given them (paths absolute), never its derived values:
launch/train.py derives them again for this run (decay_tokens from this train.steps, the mesh
from these devices), prints what changed, and any key can still be overridden: on a run of
launch/train.py, another recipe or data stream with --accept_changes, never another model or
tokenizer (docs/checkpoints.md, "What a resume may change"; an import takes any).
"""

import ml_collections

from mtnlg_jax.run.rundir import RunDir


def get_config(workdir):
    return ml_collections.ConfigDict(RunDir(workdir).read_inputs())
