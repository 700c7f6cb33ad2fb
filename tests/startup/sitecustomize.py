"""Imported at start-up by every Python the tests start (conftest.py puts this folder first on
PYTHONPATH): the tools, spawn's processes, Ray's workers. Python's cycle collector at the
thresholds the test processes use (conftest.py): at its defaults it took 0.6 of a short
launch/train.py run's 15.6 CPU-s, 0.1 at these. Nothing else: the tools run as a user's."""

import gc

gc.set_threshold(10_000, 10, 10)
