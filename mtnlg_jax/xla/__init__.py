"""What is settled before JAX starts, and what devices can do; imports nothing of the package.

flags.py         the recommended XLA:GPU flags (the user's XLA_FLAGS win)
options.py       a config's own XLA options (train.xla_options), checked by XLA first
gpu_compile.py   the XLA:GPU compiler for machines without a GPU (.gpu-compile/)
devices.py       peak dense TFLOP/s per device kind (MFU)
"""
