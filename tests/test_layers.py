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
# What each layer (a folder of mtnlg_jax) may import, besides itself. config and xla import
# nothing; run imports no JAX at import time, so a launch script checks its command line
# before JAX starts; data declares its batch layout by logical names, hence the rule table
# (parallel); data and eval never import the trainer; plan compiles the trainer's own step,
# so it sits above train.
ALLOWED = {
    'config': set(),
    'xla': set(),
    'run': {'config'},
    'interop': {'config'},
    'parallel': {'config', 'run'},
    'model': {'config', 'parallel'},
    'data': {'config', 'run', 'parallel'},
    'checkpoint': {'config', 'run', 'parallel'},
    'train': {'config', 'xla', 'run', 'parallel', 'model', 'data', 'checkpoint'},
    'eval': {'config', 'run', 'parallel', 'model', 'data', 'checkpoint'},
    'plan': {'config', 'xla', 'run', 'parallel', 'model', 'data', 'train'},
}


def layer_of(path):
    return path.relative_to(PACKAGE).parts[0].removesuffix('.py')


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
                parts.add(pieces[1])
    return parts


def package_files():
    return [p for p in sorted(PACKAGE.rglob('*.py')) if p != PACKAGE / '__init__.py']


@pytest.mark.parametrize('layer', sorted(ALLOWED))
def test_no_part_imports_a_layer_above_it(layer):
    for path in package_files():
        if layer_of(path) != layer:
            continue
        relative = str(path.relative_to(PACKAGE))
        wrong = imported_parts(path) - ALLOWED[layer] - {layer}
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
    assert design_table() == ALLOWED


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


def package_folders():
    return sorted(p.parent for p in PACKAGE.rglob('__init__.py') if p.parent != PACKAGE)


def folder_contents(folder):
    """The .py files and sub-packages of a folder, as the maps name them ('x.py', 'sub/')."""
    names = {p.name for p in folder.glob('*.py') if p.name != '__init__.py'}
    return names | {f'{p.parent.name}/' for p in folder.glob('*/__init__.py')}


def test_every_package_docstring_lists_its_files():
    # Each folder's __init__.py says what each of its files is for, a line each: 'name  what'.
    for folder in package_folders():
        doc = ast.get_docstring(ast.parse((folder / '__init__.py').read_text()), clean=False) or ''
        listed = set(re.findall(r'^\s*(\w+\.py|\w+/)(?=\s\s)', doc, re.MULTILINE))
        relative = folder.relative_to(ROOT)
        assert listed == folder_contents(folder), f'{relative}/__init__.py lists {sorted(listed)}'


def design_file_map():
    """docs/design.md's "Where things are" under mtnlg_jax/: {folder: {name: planned}}, where
    planned marks a file the open work is adding (`name.py +`)."""
    text = (ROOT / 'docs' / 'design.md').read_text().split('## Where things are')[1]
    block = text.split('```')[1]
    folders, folder = {}, None
    for line in block.splitlines():
        top = re.match(r'^  (\w+)/', line)
        if line and not line.startswith(' ') and folder is not None:
            break  # past mtnlg_jax/: configs/, launch/, ...
        if top:
            folder = PACKAGE / top.group(1)
        if folder is None:
            continue
        entries = folders.setdefault(folder, {})
        for sub in re.findall(r'\b(\w+)/ ', line):
            if sub != folder.name:
                entries[f'{sub}/'] = False
        for name, plus in re.findall(r'\b(\w+\.py)( +\+)?', line):
            if name != '__init__.py':
                entries[name] = bool(plus)
    return folders


def test_the_design_file_map_names_every_file_of_the_package():
    mapped = design_file_map()
    for folder in [p for p in package_folders() if p.parent == PACKAGE]:
        names = mapped.get(folder, {})
        missing = folder_contents(folder) - set(names)
        assert not missing, f'docs/design.md does not place {folder.name}/{sorted(missing)}'
        gone = {n for n, planned in names.items() if not planned} - folder_contents(folder)
        assert not gone, f'docs/design.md names {folder.name}/{sorted(gone)}, not in the tree'
