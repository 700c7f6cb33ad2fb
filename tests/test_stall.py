"""The stall watch of the Ray tools (mtnlg_jax/data/stall.py), without Ray: a heartbeat that
stops ends the watch with one message naming tool, stage and bound; one that keeps beating,
through the wrapper the transforms run in, never does; a bound of 0 watches nothing."""

import time

from mtnlg_jax.data import stall


def watched(folder, timeout_s, work):
    """Run work(watch) under a StallWatch; the messages its on_stall got."""
    messages = []
    with stall.StallWatch(folder, timeout_s, 'curate', messages.append, poll_s=0.05) as watch:
        work(watch)
    return messages


def test_a_heartbeat_that_stops_ends_the_watch_naming_the_stage(tmp_path):
    def work(watch):
        watch.stage('fuzzy')
        time.sleep(1.0)

    messages = watched(tmp_path, 0.3, work)
    assert len(messages) == 1
    assert messages[0].startswith('curate: no progress for ')
    assert 'in stage fuzzy' in messages[0] and '--stall_timeout_s 0.3' in messages[0]
    assert str(tmp_path) in messages[0]


def test_transforms_that_keep_finishing_batches_are_never_stalled(tmp_path):
    def double(batch, folder, scale):  # a transform with a `folder` of its own, as Ray's
        return {'x': batch['x'] * scale, 'folder': folder}

    transform = stall.beating(double, str(tmp_path))

    def work(watch):
        watch.stage('signatures')
        for _ in range(12):  # 1.2 s of batches, 0.1 s each, against a bound of 0.4 s
            time.sleep(0.1)
            assert transform({'x': 3}, folder='mine', scale=2) == {'x': 6, 'folder': 'mine'}

    assert watched(tmp_path, 0.4, work) == []


def test_a_bound_of_zero_watches_nothing(tmp_path):
    watch = stall.StallWatch(tmp_path, 0, 'curate', lambda m: None)
    with watch:
        assert watch._thread is None
