"""The layout search (plan/search.py, launch/plan.py --search): every result fits, they come
fastest first, a constructed case finds the layout a hand count says is best, overrides stay
fixed, and bad input is one line."""

import dataclasses
import subprocess
import sys

import ml_collections

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.plan import clusters, predict, search
from mtnlg_jax.run import cli

# A cluster whose links and memory bandwidth are free and whose matmuls lose efficiency
# below a width of 64 per device: a step then costs its matmul FLOPs / (peak x e(width))
# alone. By hand: no pipeline (no bubble, no chunk recompute), no recompute, tensor 1 and
# micro-batch 2 (width min(b s, h / t) = 64, the widest) is the fastest.
FREE = dataclasses.replace(
    clusters.CLUSTERS['a100-80gb'],
    name='free',
    hbm_bandwidth=1e30,
    nvlink_bandwidth=1e30,
    internode_bandwidth=1e30,
    hbm_bytes=1e9,
)
HAND_BEST = {'mesh.tensor': 1, 'mesh.stage': 1, 'train.micro_batch': 2, 'model.remat': 'none'}
WIDTH_MATTERS = predict.Efficiency(0.5, 64.0, 1.0, 1.0, 'test')


def inputs(**overrides):
    config = config_lib.defaults()
    config.mesh.update(dict(data=-1, stage=1, tensor=1))
    config.model.update(
        dict(num_layers=4, hidden=64, heads=8, seq_len=32, vocab_size=300, remat='full')
    )
    config.train.update(dict(global_batch=16, micro_batch=1))
    for key, value in overrides.items():
        section, name = key.split('.')
        config[section][name] = value
    return ml_collections.ConfigDict(config.to_dict())


def pasted_back(config, entry, devices):
    """The layout `config` takes with `entry`'s printed flags applied, as a row names it."""
    pasted = [flag.removeprefix('--config.').split('=', 1) for flag in search.flags(entry).split()]
    return search.describe(config_lib.resolve(cli.apply_overrides(config, pasted), devices))


def is_hand_best(keys):
    return all(keys[key] == value for key, value in HAND_BEST.items())


def test_the_fastest_is_the_hand_counts_and_they_come_fastest_first():
    result = search.search(inputs(), 8, FREE, progress=False, figures=WIDTH_MATTERS)
    best = result['best']
    assert len(best) == 10 and is_hand_best(best[0]['keys'])
    times = [entry['step']['predicted_step_s'] for entry in best]
    assert times == sorted(times)
    assert result['baseline']['keys']['model.remat'] == 'full'  # the config as given


def test_layouts_that_do_not_fit_are_dropped():
    """2.81 MB a device: the hand count's best needs 3.27 MB (measured by the plan), and a
    layout fits with FIT_MARGIN to spare."""
    small = dataclasses.replace(FREE, hbm_bytes=2.81e6)
    result = search.search(inputs(), 8, small, progress=False, figures=WIDTH_MATTERS)
    best = result['best']
    assert len(best) == 10 and result['memory_checked'] > 10
    assert all(
        entry['per_device_bytes']['total'] * search.FIT_MARGIN <= small.hbm_bytes for entry in best
    )
    assert not any(is_hand_best(entry['keys']) for entry in best)
    # the fastest that fits: tensor 1, micro-batch 2 under selective recompute less the
    # attention's projections (2.64 MB, 2.79 with the margin; keeping them, 2.77 MB, or the
    # attention's output, 2.67 MB, it does not fit), predicted only because
    # the layout without the names did not fit (the others with names are not predicted)
    assert best[0]['keys']['model.remat_recompute'] == 'qkv,attn_out'
    assert result['predicted'] < result['layouts']


def test_overrides_stay_fixed_and_the_rest_varies():
    fixed = {'mesh.tensor', 'model.remat'}
    config = inputs(**{'mesh.tensor': 2, 'model.remat': 'selective'})
    result = search.search(config, 8, FREE, fixed=fixed, progress=False, figures=WIDTH_MATTERS)
    keys = [entry['keys'] for entry in result['best']]
    assert {(k['mesh.tensor'], k['model.remat']) for k in keys} == {(2, 'selective')}
    varied = {key for key in search.FREE_KEYS if len({k[key] for k in keys}) > 1}
    assert varied and not varied & fixed


def test_expert_ranks_are_searched_over_the_divisors_of_the_experts():
    """A mixture of 4 experts on 16 GPUs: expert x in {1, 2, 4} (1 only without tensor
    parallelism or folded), folded (model.moe.fold_tensor) wherever x t > 1 divides the
    experts, the batch over data x expert; a dense model keeps expert 1."""
    moe = inputs()
    moe.model.moe.update(dict(experts=4, top_k=2))
    found = list(search.layouts(moe, 16, 8))
    assert {layout['mesh.expert'] for layout in found} == {1, 2, 4}
    unfolded = [layout for layout in found if not layout['model.moe.fold_tensor']]
    assert all(layout['mesh.tensor'] == 1 for layout in unfolded if layout['mesh.expert'] == 1)
    folds = {(k['mesh.expert'], k['mesh.tensor']) for k in found if k['model.moe.fold_tensor']}
    assert folds == {(1, 2), (1, 4), (2, 2)}, folds
    for layout in found:
        replicas = layout['mesh.data'] * layout['mesh.expert']
        assert replicas * layout['mesh.stage'] * layout['mesh.tensor'] == 16
        assert 16 % replicas == 0 and 16 // replicas % layout['train.micro_batch'] == 0
    assert {layout['mesh.expert'] for layout in search.layouts(inputs(), 16, 8)} == {1}
    moe.mesh.expert = 2
    fixed = {'mesh.expert', 'model.remat_recompute'}  # the recompute names: searched below
    result = search.search(moe, 8, FREE, fixed, top=3, progress=False, figures=WIDTH_MATTERS)
    assert [entry['keys']['mesh.expert'] for entry in result['best']] == [2, 2, 2]
    assert all(' x2 ' in entry['layout'] for entry in result['best'])
    # the config as given at expert 1 over tensor 2 unfolded: its row says the plan cannot tell
    h100 = clusters.CLUSTERS['h100-80gb']
    for fold, printed in ((False, 'fits not known'), (True, None)):
        moe.mesh.update(dict(expert=1, tensor=2))
        moe.model.moe.fold_tensor = fold
        base = search.baseline(moe, 8, h100, WIDTH_MATTERS)
        said = search._as_given_fits(base)
        assert base['fits'] and (printed in said if printed else said == ''), (fold, said)


def test_stages_of_unequal_depth_and_fixed_folding_give_only_layouts_that_resolve():
    """10 layers with 2 on the first and last stages (pipeline.first_stage_layers /
    last_stage_layers, as configs/qwen3_235b_a22b.py's 94) on 16 GPUs: stages 1, 4 (3 layers
    a middle stage) and 8 (1), not the divisors of 10; repeats up to the shortest stage's
    layers; folding fixed on (model.moe.fold_tensor=True) with 4 experts: no expert x tensor
    that does not divide them. Every layout passes the config's checks (the search of
    Qwen3-235B-A22B refused 284 of 345 before)."""
    config = inputs(**{'model.num_layers': 10})
    config.pipeline.update(dict(first_stage_layers=2, last_stage_layers=2))
    config.model.moe.update(dict(experts=4, top_k=2, fold_tensor=True))
    fixed = {'model.moe.fold_tensor', 'model.remat'}  # full: the stages are what matters here
    found = list(search.layouts(config, 16, 8, fixed))
    assert {layout['mesh.stage'] for layout in found} == {1, 4, 8}
    repeats = {(k['mesh.stage'], k['pipeline.repeats']) for k in found}
    assert repeats == {(1, 1), (4, 1), (4, 2), (8, 1)}, repeats
    assert all(k['mesh.expert'] * k['mesh.tensor'] <= 4 for k in found if k['mesh.tensor'] > 1)
    for layout in found:
        search.with_layout(config, layout, 16, fixed)  # config.ConfigError if refused


def test_a_gpu_count_the_batch_cannot_use_is_an_error():
    try:
        search.search(inputs(), 7, FREE, progress=False)
    except search.SearchError as e:
        assert 'uses 7 GPUs' in str(e)
    else:
        raise AssertionError('no error')


def run_plan(*args):
    command = [sys.executable, str(support.ROOT / 'launch/plan.py'), *args]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=support.ROOT, env=support.TRAIN_ENV,
        timeout=280,
    )  # fmt: skip


def test_the_command_line_searches_and_refuses_bad_input(tmp_path, capsys, monkeypatch):
    """The search at the command line; each bad flag through plan.py's main(argv) in this
    process (a subprocess each cost a JAX start-up; the command line's own refusals:
    test_command_line_contract.py)."""
    out = tmp_path / 'best.json'
    result = run_plan(
        '--config', 'configs/tiny.py', '--search', '--cluster', 'a100-80gb', '--devices', '8',
        '--config.model.remat=full', '--json', str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'fixed: model.remat' in result.stdout and out.exists()
    assert 'predicting layouts' in result.stderr  # progress while it works
    config = support.ROOT / 'configs/tiny.py'
    for args, flag in (
        (['--cluster', 'nope', '--devices', '8'], '--cluster'),
        (['--cluster', 'a100-80gb', '--devices', '7'], '--devices 7'),
        (['--cluster', 'a100-80gb'], '--devices N or --nodes N'),
    ):
        status, _, lines = support.launch_in_process(
            'plan', capsys, monkeypatch, '--config', config, '--search', *args
        )
        assert status == 2, lines
        assert len(lines) == 1 and lines[0].startswith('error:') and flag in lines[0], lines


def test_the_zero_bubble_schedules_the_in_flight_bounds_and_the_recompute_are_searched():
    """8 layers on 8 GPUs: at one chunk a stage 1F1B and ZB-H1, at two interleaved and ZB-V,
    beyond interleaved alone, each unbounded and bounded to p in flight; interleaved above p
    too (stage 0's chunk inputs) up to the unbounded table: at p 4, v 2, m 8 the bounds 4 and
    5 (8 and 10 chunk inputs, 33 and 27 ticks; 6 is the unbounded table, 11 held, 26 ticks);
    under selective recompute the names of search.RECOMPUTES. The row names the schedule, the
    bound and the names, and the printed flags give the layout back."""
    config = inputs(**{'model.num_layers': 8})
    found = list(search.layouts(config, 8, 8))
    piped = {(k['pipeline.repeats'], k['pipeline.schedule']) for k in found if k['mesh.stage'] > 1}
    assert piped == {(1, '1f1b'), (1, 'zbh1'), (2, 'interleaved'), (2, 'zbv'), (4, 'interleaved')}
    bounds = {(k['mesh.stage'], k['pipeline.repeats'], k['pipeline.max_in_flight']) for k in found}
    assert {(2, 2, 0), (2, 2, 2), (4, 1, 4)} <= bounds
    shape = ('mesh.stage', 'pipeline.repeats', 'mesh.data', 'train.micro_batch', 'model.remat')
    at_m8 = [k for k in found if tuple(k[key] for key in shape) == (4, 2, 2, 1, 'selective')]
    tried = {(k['pipeline.schedule'], k['pipeline.max_in_flight']) for k in at_m8}
    assert tried == {('interleaved', 0), ('interleaved', 4), ('interleaved', 5), ('zbv', 0),
                     ('zbv', 4)}, tried  # fmt: skip
    names = {(k['model.remat'], k['model.remat_recompute']) for k in found}
    assert names == {('none', ''), ('full', '')} | {('selective', n) for n in search.RECOMPUTES}
    zbv = next(k for k in found if k['pipeline.schedule'] == 'zbv' and k['mesh.stage'] == 2)
    resolved = search.with_layout(config, zbv, 8)
    assert resolved.pipeline.schedule == 'zbv' and ' v2 zbv ' in search.describe(resolved)
    layout = next(
        k for k in at_m8 if k['pipeline.max_in_flight'] == 5 and k['model.remat_recompute']
    )
    resolved = search.with_layout(config, layout, 8)
    text = search.describe(resolved)
    assert ' inflight5 ' in text and f' recompute {layout["model.remat_recompute"]}' in text
    entry = {'keys': {key: search._get(resolved, key) for key in search.FREE_KEYS}}
    assert pasted_back(inputs(**{'model.num_layers': 8}), entry, 8) == text


def test_a_long_sequence_searches_context_ranks_the_model_takes():
    """8200 tokens (over search.WHOLE_SEQUENCE) on 8 GPUs: context c in 1, 2, 4 (8 would cut
    8200 into 16 chunks: config/checks.py refuses), sequence parallelism only where 2 c t
    chunks divide it (not at t2 c4 nor t4 c2), every layout resolves; the 32-token sequence
    draws c = 1 alone unless --config.mesh.context fixes it. On H100s rank 1 splits the
    sequence (a batch of 4 leaves data at most 4 of 8 GPUs), its row prints c and its flags
    give the layout back."""
    long = inputs(**{'model.seq_len': 8200, 'model.num_layers': 2, 'train.global_batch': 4})
    fixed = {'model.remat'}  # full: the mesh is what matters here
    found = list(search.layouts(long, 8, 8, fixed))
    meshes = {(k['mesh.tensor'], k['mesh.context'], k['model.sequence_parallel']) for k in found}
    assert {c for _, c, _ in meshes} == {1, 2, 4}
    assert (2, 2, True) in meshes and not {(2, 4, True), (4, 2, True)} & meshes, meshes
    for layout in found:
        search.with_layout(long, layout, 8, fixed)  # config.ConfigError if refused
    assert {k['mesh.context'] for k in search.layouts(inputs(), 8, 8)} == {1}
    short = inputs(**{'mesh.context': 2})
    kept = list(search.layouts(short, 8, 8, {'mesh.context', 'model.remat'}))
    assert kept and {k['mesh.context'] for k in kept} == {2}
    search.with_layout(short, kept[-1], 8, {'mesh.context'})
    h100 = clusters.CLUSTERS['h100-80gb']
    best = search.search(long, 8, h100, fixed, top=1, progress=False)['best'][0]
    context = best['keys']['mesh.context']
    assert context > 1 and f' c{context} ' in best['layout'], best['layout']
    assert pasted_back(long, best, 8) == best['layout']
