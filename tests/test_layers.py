"""Imports flow one way (docs/design.md, "Layers"): read from the source, nothing imported."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'mtnlg_jax'
# What each part of the package must never import. The lower layers know nothing of the
# trainer or the planner; data and evaluation never need them; cli.py, rundir.py and
# distributed.py stay free of JAX at import (distributed imports it only once the command
# line is checked). The planner's arithmetic sits below the trainer (train/ reports its
# figures); only plan/compile.py, which compiles the trainer's step, sits above it.
FORBIDDEN = {
    'config': ('parallel', 'model', 'train', 'eval', 'checkpoint', 'plan', 'distributed'),
    'rundir': ('config', 'parallel', 'model', 'train', 'eval', 'data', 'checkpoint', 'plan'),
    'cli': ('parallel', 'model', 'train', 'eval', 'checkpoint', 'plan', 'distributed'),
    'distributed': ('config', 'parallel', 'model', 'train', 'eval', 'data', 'checkpoint', 'plan'),
    'parallel': ('train', 'eval', 'data', 'checkpoint', 'plan'),
    'model': ('train', 'eval', 'data', 'checkpoint', 'plan'),
    'data': ('train', 'eval', 'model', 'checkpoint', 'plan'),
    'eval': ('train', 'plan'),
    'plan': ('train', 'eval', 'checkpoint'),
}
ABOVE_TRAIN = {'plan/compile.py': ('train',)}  # the one file allowed what its part is not


def imported_parts(path):
    """The first component after `mtnlg_jax.` of every import in a file (lazy ones too)."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            pieces = name.split('.')
            if pieces[0] == 'mtnlg_jax' and len(pieces) > 1:
                parts.add(pieces[1])
    return parts


@pytest.mark.parametrize('part', sorted(FORBIDDEN))
def test_no_part_imports_a_layer_above_it(part):
    files = sorted((PACKAGE / part).rglob('*.py')) or [PACKAGE / f'{part}.py']
    for path in files:
        allowed = set(ABOVE_TRAIN.get(str(path.relative_to(PACKAGE)), ()))
        wrong = imported_parts(path) & (set(FORBIDDEN[part]) - allowed)
        assert not wrong, f'{path.relative_to(PACKAGE.parent)} imports mtnlg_jax.{sorted(wrong)}'
