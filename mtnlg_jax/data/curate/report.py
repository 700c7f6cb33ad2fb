"""What each stage did: documents and bytes in, out and removed, why, and a few examples.

Decontamination may cut a document into several pieces (each written as a document): its
documents out are those with any piece left, its bytes out those of the pieces, and
`pieces_out` how many lines it wrote.

The pipeline fills one StageReport per stage; the whole report is written as JSON next to the
output (`OUTPUT.report.json` for `OUTPUT.jsonl`) and printed as a table.
"""

import collections
import os

EXAMPLE_CHARACTERS = 300


class StageReport:
    def __init__(self, name, examples=3):
        self.name, self.max_examples = name, examples
        self.documents_in = self.bytes_in = self.documents_out = self.bytes_out = 0
        self.seconds = 0.0  # compute: summed over the worker processes, plus the main one's
        self.reasons = collections.Counter()
        self.examples = []
        self.details = {}

    def take(self, size):
        self.documents_in, self.bytes_in = self.documents_in + 1, self.bytes_in + size

    def give(self, size):
        self.documents_out, self.bytes_out = self.documents_out + 1, self.bytes_out + size

    def example(self, index, text, **fields):
        if len(self.examples) < self.max_examples:
            self.examples.append({'index': index, **fields, 'text': text[:EXAMPLE_CHARACTERS]})

    def as_dict(self):
        return {
            'stage': self.name,
            'documents_in': self.documents_in,
            'bytes_in': self.bytes_in,
            'documents_out': self.documents_out,
            'bytes_out': self.bytes_out,
            'documents_removed': self.documents_in - self.documents_out,
            'bytes_removed': self.bytes_in - self.bytes_out,
            'seconds': round(self.seconds, 3),
            **({'reasons': dict(self.reasons.most_common())} if self.reasons else {}),
            **self.details,
            'examples': self.examples,
        }


def report_path(output):
    """OUTPUT.report.json beside OUTPUT (its extension replaced)."""
    return os.path.splitext(output)[0] + '.report.json'


def table(report):
    """The report's stages as an aligned text table."""
    rows = [('stage', 'docs in', 'docs out', 'removed', 'MB in', 'MB removed', 'compute s')]
    for s in report['stages']:
        share = s['documents_removed'] / max(s['documents_in'], 1)
        rows.append(
            (
                s['stage'],
                f"{s['documents_in']:,}",
                f"{s['documents_out']:,}",
                f"{s['documents_removed']:,} ({share:.1%})",
                f"{s['bytes_in'] / 1e6:.2f}",
                f"{s['bytes_removed'] / 1e6:.2f} "
                f"({s['bytes_removed'] / max(s['bytes_in'], 1):.1%})",
                f"{s['seconds']:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def merged(name, parts, max_examples):
    """One stage's report (a dict, as StageReport.as_dict) from those of consecutive pieces:
    counts and seconds summed, reasons counted, the first examples kept, details summed when
    numbers (and taken from the first piece otherwise)."""
    total = StageReport(name, max_examples)
    details = {}
    for part in parts:
        total.documents_in += part['documents_in']
        total.bytes_in += part['bytes_in']
        total.documents_out += part['documents_out']
        total.bytes_out += part['bytes_out']
        total.seconds += part['seconds']
        total.reasons.update(part.get('reasons', {}))
        total.examples += part['examples'][: max_examples - len(total.examples)]
        for key, value in part.items():
            if key not in _FIELDS:
                details[key] = details.get(key, 0) + value if isinstance(value, int) else value
    total.details = details
    return total


_FIELDS = {
    'stage', 'documents_in', 'bytes_in', 'documents_out', 'bytes_out', 'documents_removed',
    'bytes_removed', 'seconds', 'reasons', 'examples',
}  # fmt: skip
