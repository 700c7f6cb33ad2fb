#!/usr/bin/env python3
"""Export the default corpus (mtnlg_jax/data/corpus.py) as one jsonl file per source.

    python launch/export_corpus.py --out data/default/raw

writes kjv.jsonl (the King James Bible, a chapter per line) and python_stdlib.jsonl (Python
standard-library files), each line {"text": document}: the input of launch/preprocess.py,
which turns each into its own .bin/.idx pair for configs/tiny.py to blend. Each file appears
(by rename) only once complete.
"""

import json
import os
import sys
import time

try:
    import mtnlg_jax  # noqa: F401  (normally pip-installed in editable mode)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtnlg_jax.run.cli import ArgumentParser, check_output, fail  # noqa: E402
from mtnlg_jax.data.corpus import default_sources  # noqa: E402


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    parser.add_argument('--out', required=True, help='folder for <source>.jsonl')
    args = parser.parse_args(argv)
    check_output(args.out, '--out', directory=True, make=True)
    for name, factory in default_sources():
        start, path = time.perf_counter(), os.path.join(args.out, f'{name}.jsonl')
        count, characters = 0, 0
        try:  # a full disk: one line, the .tmp removed, earlier files kept
            with open(path + '.tmp', 'w', encoding='utf-8') as f:
                for text in factory():
                    f.write(json.dumps({'text': text}, ensure_ascii=False) + '\n')
                    count, characters = count + 1, characters + len(text)
            os.replace(path + '.tmp', path)
        except OSError as e:
            if os.path.exists(path + '.tmp'):
                os.remove(path + '.tmp')
            fail(f'--out {args.out}: {path} not written ({e.strerror or e})')
        print(
            f'wrote {path}: {count:,} documents, {characters / 1e6:.1f} M characters '
            f'({time.perf_counter() - start:.1f} s)'
        )
    return 0


if __name__ == '__main__':
    sys.exit(main())
