"""The process around a run; nothing here imports JAX at import time, so a launch script
rejects bad input before JAX starts.

    cli.py           the command-line contract every launch script keeps (docs/cli.md)
    rundir.py        the workdir: config.json, checkpoints/, metrics, eval/, logs/
    distributed.py   several processes: jax.distributed before any JAX call, node of a device
    storage.py       a write the storage refuses (full disk, quota, read-only) as one line
"""
