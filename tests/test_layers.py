"""Imports flow one way (docs/design.md, "Layers"): read from the source, nothing imported.

Each part of the package (a top-level module or folder of mtnlg_jax) names the parts it may
import; anything else is an upward import. The table is docs/design.md's, and a test holds
the two equal, so the diagram cannot drift from what is enforced.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'mtnlg_jax'
# Modules that belong to another part's layer: the config's pure arithmetic sits with it.
LAYER_OF = {
    'config_checks': 'config',
    'rampup': 'config',
    'xla_flags': 'compiler',
    'gpu_compile': 'compiler',
}
# What each layer may import, besides itself. cli, rundir and distributed import no JAX at
# import time, so a launch script checks its command line before JAX starts; data declares
# its batch layout by logical names, hence the rule table (parallel); data and eval never
# import the trainer; the planner's arithmetic sits below the trainer (train/ reports it).
ALLOWED = {
    'config': set(),
    'compiler': set(),
    'rundir': set(),
    'hf_gpt2': set(),
    'cli': {'config', 'rundir'},
    'distributed': {'config', 'cli'},
    'parallel': {'config', 'distributed'},
    'model': {'config', 'parallel'},
    'data': {'config', 'parallel'},
    'checkpoint': {'config', 'rundir', 'parallel'},
    'plan': {'config', 'compiler', 'cli', 'parallel', 'model'},
    'train': {
        'config',
        'compiler',
        'rundir',
        'distributed',
        'parallel',
        'model',
        'data',
        'checkpoint',
        'plan',
    },  # fmt: skip
    'eval': {'config', 'rundir', 'parallel', 'model', 'data', 'checkpoint'},
}
# The files that may reach above their layer, each named in docs/design.md with the reason.
EXCEPTIONS = {
    'plan/compile.py': {'train', 'data'},  # compiles the trainer's step on abstract state
}


def layer_of(path):
    first = path.relative_to(PACKAGE).parts[0].removesuffix('.py')
    return LAYER_OF.get(first, first)


def imported_parts(path):
    """The layer of every mtnlg_jax import in a file (lazy ones too)."""
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
                parts.add(LAYER_OF.get(pieces[1], pieces[1]))
    return parts


def package_files():
    return [p for p in sorted(PACKAGE.rglob('*.py')) if p != PACKAGE / '__init__.py']


@pytest.mark.parametrize('layer', sorted(ALLOWED))
def test_no_part_imports_a_layer_above_it(layer):
    for path in package_files():
        if layer_of(path) != layer:
            continue
        relative = str(path.relative_to(PACKAGE))
        allowed = ALLOWED[layer] | EXCEPTIONS.get(relative, set()) | {layer}
        wrong = imported_parts(path) - allowed
        assert not wrong, f'mtnlg_jax/{relative} imports mtnlg_jax.{sorted(wrong)}'


def test_every_module_has_a_layer():
    unplaced = {str(p.relative_to(PACKAGE)) for p in package_files() if layer_of(p) not in ALLOWED}
    assert not unplaced, f'place these in ALLOWED and docs/design.md: {sorted(unplaced)}'


def design_table():
    """docs/design.md's "| layer | may import |" rows: {layer: set of layers}."""
    rows, inside = {}, False
    for line in (ROOT / 'docs' / 'design.md').read_text().splitlines():
        if line.startswith('| layer | may import'):
            inside = True
        elif inside and not line.startswith('|'):
            break
        elif inside and not line.startswith('|---'):
            cells = [cell.strip() for cell in line.strip('|').split('|')]
            names = re.findall(r'`([\w/.]+)`', cells[0])
            rows[names[0]] = set(re.findall(r'`(\w+)`', cells[1]))
    return rows


def test_the_design_documents_the_rules_the_test_enforces():
    table = design_table()
    exceptions = {name: table.pop(name) for name in list(table) if name.endswith('.py')}
    assert table == ALLOWED
    assert exceptions == EXCEPTIONS


def test_an_upward_import_is_caught(tmp_path):
    # The check itself can fail: data importing the trainer, as a lazy import in a function.
    source = tmp_path / 'loader.py'
    source.write_text('def f():\n    from mtnlg_jax.train import step\n    return step\n')
    assert imported_parts(source) - ALLOWED['data'] == {'train'}


def imported_modules(path):
    """The mtnlg_jax modules a file imports, as files of the package (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f'{node.module}.{alias.name}' for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith('mtnlg_jax.'):
                module = ROOT.joinpath(*name.split('.')).with_suffix('.py')
                if module.is_file():
                    found.add(module)
    return found


def test_no_modules_import_each_other():
    # Within a layer too: a cycle (a -> b -> a) means neither can be read without the other.
    graph = {path: imported_modules(path) - {path} for path in package_files()}
    state = {}

    def visit(path, trail):
        state[path] = 'open'
        for target in graph.get(path, ()):
            if state.get(target) == 'open':
                cycle = trail[trail.index(target) :] + [target]
                raise AssertionError(' -> '.join(str(p.relative_to(ROOT)) for p in cycle))
            if target not in state:
                visit(target, trail + [target])
        state[path] = 'done'

    for path in graph:
        if path not in state:
            visit(path, [path])
