"""Operating a long run: a profile of a range of steps on request (train.profile_*)."""

import gzip
import json

from support import SMALL_MODEL, run_train

RUN = [
    *SMALL_MODEL,
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.train.eval_batches=1',
    '--config.checkpoint.every=3',
]


def test_a_profile_of_steps_is_traced_under_the_workdir_with_the_phases_annotated(
    tmp_path, token_data
):
    """Steps 2-3 of 4 traced by process 0: a TensorBoard (.xplane.pb) and a Perfetto trace
    under WORKDIR/profile, the log line naming it, each step and its batch, step and save
    phases annotated."""
    workdir = tmp_path / 'run'
    profile = ['--config.train.profile_start=2', '--config.train.profile_steps=2']
    result = run_train(workdir, *RUN, '--config.train.steps=4', *profile, data=token_data)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith('profile ')]
    assert len(lines) == 1 and lines[0].startswith('profile      steps 2-3 traced: '), lines
    traced = lines[0].split('traced: ')[1]
    assert traced.startswith(str(workdir / 'profile' / 'process_0')), traced
    assert list((workdir / 'profile').rglob('*.xplane.pb')), 'no TensorBoard trace'
    (perfetto,) = (workdir / 'profile').rglob('perfetto_trace.json.gz')
    events = json.loads(gzip.decompress(perfetto.read_bytes()))['traceEvents']
    names = [event.get('name') for event in events]
    assert names.count('train') == 2, 'one StepTraceAnnotation per traced step'
    for phase in ('batch', 'step', 'save'):
        assert names.count(phase) == 2, phase
