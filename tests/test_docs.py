"""The README and docs/ say what exists: every relative link resolves (file and heading), and
every command in a code block names a script, flags, config keys, make targets and repository
files that exist (each script's own `--help` says which flags it takes); and the cheap
commands run as written: the README's tour end to end on a small committed corpus (a clean
clone has no data/), the planner's arithmetic, a typo's error line."""

import contextlib
import functools
import io
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys

import pytest
from support import launch_in_process

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```.*?^```', re.S | re.M)
# A command line in a code block: optional VAR=value prefixes, then one of these.
COMMAND = re.compile(r'^(?:command:\s+)?(?:[A-Z_]+=\S+\s+)*(python|make|sbatch)\s+(.*)$')
REPO_PATH = re.compile(r'^(configs|launch|bench|harness_tasks|docs|tests)/[\w./-]+$')


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r'[`*_]', '', heading.strip().lower())
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(page):
    prose = FENCE.sub('', page.read_text())
    return {slug(line.lstrip('#')) for line in prose.splitlines() if line.startswith('#')}


def links(page):
    prose = FENCE.sub('', page.read_text())
    prose = re.sub(r'`[^`\n]*`', '', prose)  # inline code is not a link
    return [target for target in LINK.findall(prose) if not re.match(r'[a-z]+:', target)]


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition('#')
        file = (page.parent / path).resolve() if path else page
        relative = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if not file.exists():
            broken.append(f'{target}: no file {relative}')
        elif anchor and file.suffix == '.md' and anchor not in anchors(file):
            broken.append(f'{target}: no heading #{anchor} in {relative}')
    assert not broken, f'{page.relative_to(ROOT)}: ' + '; '.join(broken)


def command_lines(page, text=None):
    """Every command of the page's code blocks (or of `text`), continuation lines joined,
    comments cut."""
    for block in FENCE.findall(page.read_text() if text is None else text):
        lines = block.splitlines()[1:-1]
        joined, pending = [], ''
        for line in lines:
            if pending:
                line = pending + ' ' + line.strip()
            if line.rstrip().endswith('\\'):
                pending = line.rstrip()[:-1]
                continue
            pending = ''
            joined.append(line.strip())
        for line in joined:
            match = COMMAND.match(line)
            if match:
                yield match.group(1), re.sub(r'\s+#.*$', '', match.group(2))


@functools.cache
def help_text(script):
    """`--help` of a script (for launch/harness.py, also lm-eval's `run`, which takes the
    flags it does not know)."""
    text = script_help(script)
    if script == 'launch/harness.py':
        text += run_help([sys.executable, '-m', 'lm_eval', 'run', '--help'])
    return text


def script_help(script):
    """What `python SCRIPT --help` prints, run in this process (a second interpreter and JAX
    would cost each bench script a second): the environment the script sets is put back."""
    argv, path, environ, out = sys.argv, list(sys.path), dict(os.environ), io.StringIO()
    sys.argv = [str(ROOT / script), '--help']
    sys.path.insert(0, str((ROOT / script).parent))  # as python SCRIPT puts it first
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / script), run_name='__main__')
    except SystemExit as e:
        assert e.code in (0, None), f'{script} --help: exit status {e.code}'
    finally:
        sys.argv, sys.path[:] = argv, path
        os.environ.clear()
        os.environ.update(environ)
    return out.getvalue()


def run_help(argv):
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, f'{argv}: {result.stderr[-2000:]}'
    return result.stdout


def config_keys(text):
    """{'model.hidden', 'train.rampup.start', ...} from the `--help` of a tool with a config."""
    return set(re.findall(r'^  (\w+\.[\w.]+)=', text, re.M))


def problems_of_python(words):
    """What is wrong with `python SCRIPT ARGS` (and the command after spawn.py's `--`)."""
    if words[:1] == ['-m']:
        return []  # a module of an installed package (pytest, ...)
    script, args = words[0], words[1:]
    if not (ROOT / script).is_file():
        return [f'no script {script}']
    inner = []
    if '--' in args:
        args, inner = args[: args.index('--')], args[args.index('--') + 1 :]
    text = help_text(script)
    problems = []
    for word in args:
        word = word.strip('[]')
        flag = word.split('=', 1)[0]
        if flag.startswith('--config.'):
            key = flag[len('--config.') :]
            if key != key.lower():  # a placeholder: --config.SECTION.KEY=VALUE
                continue
            if key not in config_keys(text):
                problems.append(f'{script}: no config key {key}')
        elif flag.startswith('--') and flag != '--' and not re.search(rf'{flag}\b', text):
            problems.append(f'{script}: no flag {flag}')
        elif REPO_PATH.match(word.split(':')[0]) and not (ROOT / word.split(':')[0]).exists():
            problems.append(f'no file {word}')
    if inner:
        problems += problems_of_python(inner)
    return problems


def problems_of(program, rest):
    try:
        words = shlex.split(rest)
    except ValueError as error:
        return [f'{rest}: {error}']
    if program == 'python':
        return problems_of_python(words)
    if program == 'make':
        targets = set(re.findall(r'^([\w-]+):', (ROOT / 'Makefile').read_text(), re.M))
        return [f'no make target {t}' for t in words if '=' not in t and t not in targets]
    missing = [w for w in words if REPO_PATH.match(w) and not (ROOT / w).exists()]
    return [f'no file {w}' for w in missing]  # sbatch: its script and config


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_names_what_exists(page):
    problems = []
    for program, rest in command_lines(page):
        problems += [f'`{program} {rest}`: {p}' for p in problems_of(program, rest)]
    assert not problems, '\n'.join(problems)


def test_the_checks_find_what_is_wrong(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text(
        '# Title\n[ok](#title) [gone](nowhere.md) [no heading](#other)\n'
        '```\npython launch/train.py --config configs/tiny.py --workdir w --no_such_flag\n'
        'python launch/train.py --config configs/none.py --config.model.hiden=3 \\\n'
        '    --workdir w   # a comment --not_a_flag\n'
        'make trian\nsbatch launch/slurm/none.sbatch\n```\n'
    )
    assert links(page) == ['#title', 'nowhere.md', '#other']
    assert 'title' in anchors(page) and 'other' not in anchors(page)
    found = [p for program, rest in command_lines(page) for p in problems_of(program, rest)]
    assert found == [
        'launch/train.py: no flag --no_such_flag',
        'no file configs/none.py',
        'launch/train.py: no config key model.hiden',
        'no make target trian',
        'no file launch/slurm/none.sbatch',
    ]


# The tour as written, on a committed corpus of 30 Bible chapters: only what must shrink for
# 120 KB of text and a minute of suite time changes (its tokenizer's size, and the model and
# steps appended as later overrides, which win).
TOUR_CORPUS = ROOT / 'tests/fixtures/curation/good.jsonl'
TOUR_VOCAB = 320
TOUR_TRAIN = [
    f'--config.model.vocab_size={TOUR_VOCAB}',
    *('--config.mesh.data=4', '--config.mesh.stage=1', '--config.mesh.tensor=2'),
    *('--config.pipeline.repeats=1', '--config.model.remat=none'),
    *('--config.model.num_layers=2', '--config.model.hidden=64', '--config.model.seq_len=64'),
    *('--config.train.steps=2', '--config.train.eval_every=0', '--config.train.micro_batch=2'),
]


def section(page, heading):
    text = page.read_text()
    start = text.index(f'\n## {heading}')
    end = text.find('\n## ', start + 1)
    return text[start : end if end > 0 else None]


def as_run(words):
    """A tour command's words with the corpus and sizes of the committed fixture."""
    words = [str(TOUR_CORPUS) if w == 'my.jsonl' else w for w in words]
    if '--vocab-size' in words:
        words[words.index('--vocab-size') + 1] = str(TOUR_VOCAB)
    if words[0] == 'launch/train.py':
        words += TOUR_TRAIN
    return words


def run_in(folder, words, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The tools make their own devices, as for a user; conftest.py's cheaper LLVM backend
    # stays (it halves the tour's compiles, and the tour checks what runs, not its speed).
    flags = [f for f in env.pop('XLA_FLAGS', '').split() if 'device_count' not in f]
    if flags:
        env['XLA_FLAGS'] = ' '.join(flags)
    return subprocess.run(
        [sys.executable, *words], capture_output=True, text=True, cwd=folder, env=env,
        timeout=timeout,
    )  # fmt: skip


def test_the_readme_tour_runs_as_written(tmp_path, capsys, monkeypatch):
    """The tour's commands as written (the committed corpus and sizes swapped in: as_run),
    each the tool's main(argv) in this process, curate and preprocess on one embedded Ray
    (ray_engine.started takes a Ray already running in the process): a Ray start and five
    interpreter starts fewer for the suite. test_command_line_contract.py runs every tool's
    command line itself."""
    from mtnlg_jax.data import ray_engine

    for name in ('launch', 'configs'):
        (tmp_path / name).symlink_to(ROOT / name)
    commands = list(command_lines(PAGES[0], section(PAGES[0], 'A five-minute tour')))
    scripts = [shlex.split(rest)[0] for _, rest in commands]
    assert scripts == [f'launch/{name}.py' for name in
                       ('curate', 'preprocess', 'train', 'evaluate', 'generate')]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with ray_engine.started(2, object_store_mb=80):
        for program, rest in commands:
            assert program == 'python'
            script, *args = as_run(shlex.split(rest))
            tool = pathlib.Path(script).stem
            status, _, lines = launch_in_process(tool, capsys, monkeypatch, *args)
            assert status == 0, f'{rest}\n' + '\n'.join(lines[-30:])
    assert (tmp_path / 'data/mine/text.identity.json').is_file()
    assert list((tmp_path / 'runs/mine/eval').glob('perplexity_text_valid_step2.json'))


def test_the_planners_arithmetic_runs_as_written():
    """Each of the pages' planner commands without a compile, once (the pages repeat them)."""
    commands = {
        rest: shlex.split(rest)
        for page in PAGES
        for program, rest in command_lines(page)
        if program == 'python' and rest.startswith('launch/plan.py') and '--cluster' in rest
        and not {'--search', '--target', '--compile'} & set(shlex.split(rest))
    }  # fmt: skip
    assert commands
    for words in list(commands.values())[:3]:
        result = run_in(ROOT, words, timeout=120)
        assert result.returncode == 0, f'{words}\n{result.stderr[-2000:]}'


def test_a_typo_of_a_required_flag_names_the_typo():
    result = run_in(ROOT, ['launch/train.py', '--config', 'configs/tiny.py', '--workdri', 'x'])
    assert result.returncode == 2
    assert result.stderr.strip() == (
        'error: unrecognized argument --workdri; did you mean --workdir?'
    )


def test_the_change_of_layout_example_resolves_on_its_config():
    """docs/checkpoints.md's resume under another layout: its overrides fit configs/tiny.py
    (the ramp-up's first batch divides the new layout)."""
    from mtnlg_jax import config as config_lib
    from mtnlg_jax.run import cli

    page = ROOT / 'docs/checkpoints.md'
    commands = [shlex.split(rest) for program, rest in command_lines(page) if program == 'python']
    layout = next(words for words in commands if '--config.mesh.data=4' in words)
    overrides, rest = cli.split_overrides(layout[1:])
    config = cli.apply_overrides(
        cli.load_config(str(ROOT / rest[rest.index('--config') + 1])), overrides
    )
    resolved = config_lib.resolve(config, 8)
    assert (resolved.mesh.data, resolved.mesh.stage, resolved.mesh.tensor) == (4, 1, 2)
