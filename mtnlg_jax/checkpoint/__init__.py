"""Checkpoints: orbax save and restore onto any layout, below both the trainer and evaluation.

store.py   save / restore of the sharded state, shape checks, skipping unusable ones
slices.py  a checkpoint's parameters read on the host a layer at a time (export)
shared_failure.py  a write failed on one process fails the save on all; the save drill
"""
