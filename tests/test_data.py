"""The tokenizer and the default corpus, on tiny inputs (fast)."""

import hashlib
import os
import random
import re

import pytest

from mtnlg_jax.data import corpus
from mtnlg_jax.data.tokenizer import Tokenizer, TokenizerError


def synthetic_documents(n=40, seed=0):
    """Small, varied documents: Python-like code and prose, with indentation."""
    rng = random.Random(seed)
    words = (
        "the and of to in that for with value index name data self "
        "return import class def if else while yield light earth"
    ).split()
    docs = []
    for d in range(n):
        lines = [f"def function_{d}(x, y=1):"]
        for _ in range(rng.randint(3, 8)):
            indent = "    " * rng.randint(1, 3)
            lines.append(
                indent
                + " ".join(rng.choice(words) for _ in range(rng.randint(1, 7)))
                + rng.choice(["", ":", " = 42", "  # note", "()", "[0]"])
            )
        lines.append("")
        lines.append(" ".join(rng.choice(words) for _ in range(12)).capitalize() + ".")
        docs.append("\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    return Tokenizer.train(synthetic_documents(), prefix, vocab_size=320)


# --- tokenizer ---------------------------------------------------------------


def test_tokenizer_round_trips_newlines_indentation_tabs_and_spaces(tokenizer):
    texts = [
        "def f(x):\n    return x  +  1\n\n\nclass A:\n\tpass\n",
        "    leading spaces and trailing   ",
        "\n\nblank lines\r\nand a CRLF\x0c\n  \n",
        "mixed\t \tindent\n        deep = 42\n",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_unseen_characters_via_bytes(tokenizer):
    text = "Ünïcödé ∑ 😀 {Q}|~ 1234567890"
    ids = tokenizer.encode(text)
    assert 0 not in ids  # byte fallback: never <unk>
    assert tokenizer.decode(ids) == text


def test_tokenizer_newline_is_a_single_token(tokenizer):
    ids = tokenizer.encode("a\nb")
    assert [tokenizer.id_to_piece(i) for i in ids].count("\n") == 1


def test_encode_document_appends_eod_and_decode_drops_it(tokenizer):
    text = "def g():\n    return 1\n"
    ids = tokenizer.encode_document(text)
    assert tokenizer.eod_id == 1
    assert ids == tokenizer.encode(text) + [tokenizer.eod_id]
    assert tokenizer.eod_id not in tokenizer.encode(text)
    assert tokenizer.decode(ids + ids) == text + text


def test_tokenizer_properties(tokenizer):
    assert tokenizer.vocab_size == 320
    with open(tokenizer.model_path, "rb") as fh:
        assert tokenizer.identity == hashlib.sha256(fh.read()).hexdigest()
    assert Tokenizer(tokenizer.model_path).encode("self.value") == tokenizer.encode("self.value")


def test_tokenizer_training_is_deterministic_and_location_independent(tmp_path):
    a = Tokenizer.train(synthetic_documents(10), str(tmp_path / "a" / "tok"), 320)
    b = Tokenizer.train(synthetic_documents(10), str(tmp_path / "b" / "other"), 320)
    assert a.identity == b.identity
    assert os.path.isfile(tmp_path / "a" / "tok.vocab")


def test_tokenizer_train_rejects_bad_arguments(tmp_path):
    with pytest.raises(TokenizerError, match="model_type"):
        Tokenizer.train(synthetic_documents(5), str(tmp_path / "t"), 300, model_type="word")
    with pytest.raises(TokenizerError, match="vocab_size"):
        Tokenizer.train(synthetic_documents(5), str(tmp_path / "t"), 10)
    with pytest.raises(TokenizerError, match="too high"):
        Tokenizer.train(synthetic_documents(5), str(tmp_path / "t"), 100_000)


# --- corpus ------------------------------------------------------------------


def test_bible_documents_are_the_1189_chapters_in_order():
    docs = list(corpus.bible_documents())
    assert len(docs) == 1189
    assert docs[0].startswith(
        "Genesis 1\nIn the beginning God created the heavens and the earth.\n"
    )
    assert docs[-1].startswith("Revelation 22\n")
    assert docs[-1].rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert sum(d.count("\n") - 1 for d in docs) == 31102  # verses, one per line
    assert not any(re.search(r"\d+:\d+", d) for d in docs)  # verse markers stripped


def test_python_source_documents_are_stdlib_files_within_the_cap():
    capped = list(corpus.python_source_documents(max_bytes=300_000))
    assert capped and all(doc.strip() for doc in capped)
    assert sum(len(d.encode()) for d in capped) <= 300_000
    assert capped == list(corpus.python_source_documents(max_bytes=300_000))
    assert len(list(corpus.python_source_documents(max_files=3))) == 3
    assert any("import " in d for d in capped)
    names = [p for p, _, _ in corpus._stdlib_files()]
    assert names == sorted(names) and "os.py" in names
    assert not any(re.search(r"(^|/)(tests?|idlelib|lib2to3|site-packages)/", p) for p in names)


def test_default_sources_are_kjv_and_python_stdlib():
    sources = dict(corpus.default_sources())
    assert list(sources) == ["kjv", "python_stdlib"]
    assert next(sources["kjv"]()).startswith("Genesis 1\n")


def test_load_opens_either_kind_and_names_the_file_it_cannot_use(tokenizer, tmp_path):
    from mtnlg_jax.data.tokenizer import load

    assert load(tokenizer.model_path).identity == tokenizer.identity
    (tmp_path / "bad.model").write_text("not a model")
    (tmp_path / "empty").mkdir()
    for path, message in (
        (tmp_path / "bad.model", "bad.model: not a sentencepiece model"),
        (tmp_path / "missing", "missing: no such tokenizer"),
        (tmp_path / "empty", "empty/vocab.json: no such GPT-2 BPE vocab file"),
    ):
        with pytest.raises(TokenizerError, match=re.escape(message)):
            load(str(path))
