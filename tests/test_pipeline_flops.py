"""A pipelined step does the matmul FLOPs of the same model unpipelined at the same remat, plus
nothing: no backward recomputes its chunk from the stage input (the engine keeps its forward's
residuals), and ZB-H1's W computes only the weights' gradients from the taps its B kept
(parallel/taps.py). Compiled by XLA:CPU, conditional branches weighted by the engine's table as
the plan's HLO inventory weighs them."""

import functools

import pytest

import support
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import report

# (stage, repeats, schedule, model overrides): each against stage 1 at the same data x tensor
LAYOUTS = [
    (2, 2, 'interleaved', dict(remat='none')),
    (2, 1, '1f1b', dict(remat='full')),
    (2, 2, 'interleaved', dict(remat='selective', sequence_parallel=True)),
    (2, 1, 'zbh1', dict(remat='none')),  # 1.52 x the model's when W ran the backward again
]


@functools.cache  # stage 1 at remat none serves two layouts
def _flops_vs_model(stage, repeats, schedule, model_items):
    config = support.small_config(
        2, stage, 2, 4, repeats, schedule, num_layers=4, hidden=128, **dict(model_items)
    )
    compiled, _, info = compile_lib.compile_train_step(config)
    plan = report.add_compiled(report.make_plan(config), config, compiled, info)
    return plan['compiled']['flops_vs_model']


@pytest.mark.parametrize('layout', LAYOUTS, ids=lambda layout: f'{layout[2]}-{layout[3]["remat"]}')
def test_pipelined_matmul_flops_equal_the_unpipelined_models(layout):
    stage, repeats, schedule, model = layout
    model = tuple(sorted(model.items()))
    pipelined = _flops_vs_model(stage, repeats, schedule, model)
    plain = _flops_vs_model(1, 1, '1f1b', model)
    assert pipelined == pytest.approx(plain, rel=0.02), (pipelined, plain)
