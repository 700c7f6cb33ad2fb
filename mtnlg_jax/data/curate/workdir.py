"""The work folder of a curation run, and its outputs put into place.

    WORK/state.json          the inputs (path, bytes, SHA-256) and options it was made from;
                             a rerun with others is refused (InputError), never mixed
    WORK/NAME/ + NAME.done   a stage's parquet rows, done once the marker exists
    WORK/fuzzy/ + fuzzy.json fuzzy deduplication's removed documents (parquet), its details
    WORK/parts/part-NNNNN.jsonl + .json   a piece's survivors and its stage reports

place(): `FILE.jsonl` gets the parts concatenated in order (FILE.jsonl.tmp renamed) and its
report beside it; `DIR/` gets the parts moved in, report.json, and manifest.json last (inputs
and their hashes, options, documents per shard). The work folder goes once the outputs are
whole.
"""

import dataclasses
import json
import os
import resource
import shutil

from mtnlg_jax.data.curate.report import report_path
from mtnlg_jax.data.preprocess import InputError

STATE = 'state.json'


def peak_rss_mb():
    """This process's peak resident memory (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def is_folder_output(output):
    return str(output).endswith(os.sep) or os.path.isdir(output)


def default_folder(output):
    return str(output).rstrip(os.sep) + '.work'


def write_parquet(path, columns):
    """{name: array} as one parquet file, renamed into place once whole."""
    import pyarrow as pa  # noqa: PLC0415 (only the driver's fuzzy stage writes one)
    import pyarrow.parquet as pq  # noqa: PLC0415

    temporary = f'{path}.tmp{os.getpid()}'
    pq.write_table(pa.table(columns), temporary)
    os.replace(temporary, path)


def write_json(path, value):
    temporary = f'{path}.tmp{os.getpid()}'
    with open(temporary, 'w') as f:
        json.dump(value, f, indent=1)
    os.replace(temporary, path)


def options_record(options):
    """The options that decide the output, as JSON (the classifier and the evaluation n-grams
    enter through the identity of their files, see launch/curate.py)."""
    skip = {'classifier', 'contaminants', 'workers', 'drill', 'stall_timeout_s'}
    out = {}
    for field in dataclasses.fields(options):
        if field.name not in skip:
            value = getattr(options, field.name)
            out[field.name] = (
                dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
            )
    out['stages'] = list(out['stages'])
    return out


class Work:
    def __init__(self, folder, identity):
        self.folder, self.identity = str(folder), identity

    def path(self, name):
        return os.path.join(self.folder, name)

    def open(self, scans, options):
        """Start the folder, or check that it holds a run of these inputs and options."""
        state = {
            'inputs': [{k: s[k] for k in ('path', 'bytes', 'sha256')} for s in scans],
            'options': {**options_record(options), **self.identity},
        }
        state = json.loads(json.dumps(state))
        if os.path.exists(self.path(STATE)):
            earlier = self.read_json(STATE)
            for key in ('inputs', 'options'):
                if earlier[key] != state[key]:
                    changed = _first_change(earlier[key], state[key])
                    raise InputError(
                        f'--work_dir {self.folder}: holds a run of other {key} ({changed} '
                        'changed); remove it to start over, or rerun with the same'
                    )
            return
        os.makedirs(self.folder, exist_ok=True)
        write_json(self.path(STATE), state)

    def done(self, name):
        return os.path.exists(self.path(name + '.done'))

    def mark(self, name):
        open(self.path(name + '.done'), 'w').close()

    def part_done(self, piece):
        return os.path.exists(self.path(f'parts/part-{piece:05d}.json'))

    def read_json(self, name):
        with open(self.path(name)) as f:
            return json.load(f)

    def write_json(self, name, value):
        write_json(self.path(name), value)


def _first_change(old, new):
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return key
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for a, b in zip(old, new):
            if a != b:
                return a.get('path', '?') if isinstance(a, dict) else str(a)
    return 'the list'


def place(work, output, pieces, scans, options, report):
    """The outputs into place, whole; the work folder removed."""
    parts = [work.path(f'parts/part-{p["piece"]:05d}.jsonl') for p in pieces]
    output = str(output)
    if not is_folder_output(output):
        temporary = f'{output}.tmp{os.getpid()}'
        with open(temporary, 'wb') as out:
            for part in parts:
                with open(part, 'rb') as f:
                    shutil.copyfileobj(f, out)
        write_json(report_path(output), report)
        os.replace(temporary, output)
    else:
        os.makedirs(output, exist_ok=True)
        manifest = os.path.join(output, 'manifest.json')
        if os.path.exists(manifest):
            os.remove(manifest)
        shards = []
        for piece, part in zip(pieces, parts):
            name = os.path.basename(part)
            part_report = work.read_json(f'parts/{name[: -len(".jsonl")]}.json')
            last_stage = list(part_report['stages'].values())[-1]  # the stages in run order
            shards.append({'file': name, 'documents_in': piece['documents'],
                           'documents_out': last_stage['documents_out'],
                           'lines': part_report['written']})  # fmt: skip
            os.replace(part, os.path.join(output, name))
        write_json(os.path.join(output, 'report.json'), report)
        state = work.read_json(STATE)
        write_json(manifest, {**state, 'shards': shards, 'documents_in': report['documents_in'],
                              'documents_out': report['documents_out'],
                              'lines_out': report['lines_out']})  # fmt: skip
    shutil.rmtree(work.folder, ignore_errors=True)
