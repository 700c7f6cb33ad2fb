"""What every curation stage sees of a document: normalised words, their hashes, n-gram hashes.

    text --NFKC, lowercase--> words (\\w+ runs, with their character spans in the text)
         --crc32 | adler32 << 32--> one uint64 per word
         --sum of word hashes x fixed odd constants, mixed--> one uint64 per word n-gram

The n-gram hashes are computed for all positions at once in numpy (a weighted sum over n
shifted views), so a document costs one Python call per word (its hash) and a few array
operations, whatever n is. Everything here is a pure function of the text: the same on
every worker, in every input order.
"""

import re
import unicodedata
import zlib

import numpy as np

WORD = re.compile(r'\w+')
_MAX_N = 64
# Fixed odd multipliers, one per position in the n-gram: order-sensitive, seeded once.
_POSITION = np.random.default_rng(0x5EED).integers(1, 2**63, _MAX_N, dtype=np.uint64) * 2 + 1


def normalise(text):
    """NFKC, lowercased: what exact duplicates and word n-grams are compared on."""
    return unicodedata.normalize('NFKC', text).lower()


def exact_key(text):
    """Normalised text with whitespace runs collapsed: equal keys are exact duplicates."""
    return ' '.join(normalise(text).split())


def words(text, spans=False):
    """The normalised words of `text`; with spans, also their (start, end) in `text`.

    Spans index the original text only when normalising keeps its length (true for all but a
    few compatibility characters); decontamination asks for them and works on `text.lower()`,
    which keeps offsets for every character that matters here.
    """
    if not spans:
        return WORD.findall(normalise(text))
    found = list(WORD.finditer(text.lower()))
    return [m.group() for m in found], np.array([m.span() for m in found], np.int64).reshape(-1, 2)


def _word_hash(word):
    data = word.encode('utf-8')
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


def word_hashes(word_list):
    """One uint64 per word (crc32 in the low half, adler32 in the high half)."""
    return np.fromiter(map(_word_hash, word_list), np.uint64, len(word_list))


def _mix(h):
    """The 64-bit finaliser of MurmurHash3: every input bit reaches every output bit."""
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def ngram_hashes(hashes, n):
    """uint64 hash of each run of n consecutive words: len(hashes) - n + 1 of them (none if
    the document is shorter than n words)."""
    if not 1 <= n <= _MAX_N:
        raise ValueError(f'n-gram size must be in [1, {_MAX_N}], got {n}')
    count = len(hashes) - n + 1
    if count <= 0:
        return np.zeros(0, np.uint64)
    total = np.zeros(count, np.uint64)
    with np.errstate(over='ignore'):
        for k in range(n):
            total += hashes[k : k + count] * _POSITION[k]
        return _mix(total)
