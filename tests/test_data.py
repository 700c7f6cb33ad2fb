"""Tests of mtnlg_jax.data and launch/prepare_data.py on tiny inputs (fast)."""

import hashlib
import importlib.util
import json
import os
import random
import re

import numpy as np
import pytest

from mtnlg_jax.data import corpus
from mtnlg_jax.data.loader import (
    DataError,
    TokenWindowLoader,
    read_token_file,
    token_dtype,
    write_token_file,
)
from mtnlg_jax.data.tokenizer import Tokenizer, TokenizerError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# --- loader ------------------------------------------------------------------


def test_loader_same_seed_same_samples_different_seed_different():
    tokens = np.arange(1000, dtype=np.uint16)
    a = TokenWindowLoader(tokens, 8, seed=3).samples(0, 50)
    b = TokenWindowLoader(tokens, 8, seed=3).samples(0, 50)
    c = TokenWindowLoader(tokens, 8, seed=4).samples(0, 50)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_samples_equals_stacking_sample_across_epochs():
    loader = TokenWindowLoader(np.arange(100, dtype=np.uint16), 7, seed=1)
    n = loader.num_windows
    assert n == (100 - 1) // 7
    for start, count in [(0, 5), (n - 3, 7), (5 * n + 2, 2 * n + 1), (4, 0)]:
        got = loader.samples(start, count)
        assert got.shape == (count, 8) and got.dtype == np.int32
        want = np.stack([loader.sample(i) for i in range(start, start + count)]) if count else got
        np.testing.assert_array_equal(got, want)


def test_windows_are_consecutive_tokens_of_the_stream():
    tokens = (np.arange(500) * 7 % 251).astype(np.uint16)  # stream with distinct neighbours
    seq_len = 16
    loader = TokenWindowLoader(tokens, seq_len, seed=0)
    for i in range(3 * loader.num_windows):
        w = loader.window_index(i)
        start = w * seq_len
        np.testing.assert_array_equal(loader.sample(i), tokens[start : start + seq_len + 1])


def test_every_window_is_visited_exactly_once_per_epoch():
    loader = TokenWindowLoader(np.arange(1001, dtype=np.int32), 10, seed=5)
    n = loader.num_windows
    assert n == 100
    orders = []
    for epoch in range(3):
        batch = loader.samples(epoch * n, n)
        firsts = batch[:, 0] // 10  # window index, since tokens == positions
        assert sorted(firsts.tolist()) == list(range(n))
        orders.append(firsts.tolist())
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch


def test_samples_crossing_the_epoch_boundary():
    loader = TokenWindowLoader(np.arange(41, dtype=np.uint16), 4, seed=9)
    n = loader.num_windows  # 10
    batch = loader.samples(n - 2, 4)
    np.testing.assert_array_equal(batch[:2], loader.samples(n - 2, 2))
    np.testing.assert_array_equal(batch[2:], loader.samples(n, 2))
    epoch1 = np.random.default_rng([9, 1]).permutation(n)
    assert (batch[2:, 0] // 4).tolist() == epoch1[:2].tolist()


def test_token_file_round_trip_is_memory_mapped(tmp_path):
    path = str(tmp_path / "train.npy")
    tokens = np.arange(300, dtype=token_dtype(8192))
    write_token_file(path, tokens)
    got = read_token_file(path)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, tokens)
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32


def test_too_short_token_file_raises_data_error_naming_the_path(tmp_path):
    path = str(tmp_path / "train.npy")
    write_token_file(path, np.arange(10, dtype=np.uint16))
    with pytest.raises(
        DataError, match=re.escape(f"{path}: 10 tokens is shorter than one window of seq_len+1=129")
    ):
        TokenWindowLoader.from_file(path, 128, seed=0)


def test_missing_or_malformed_token_file_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="missing.npy"):
        read_token_file(str(tmp_path / "missing.npy"))
    bad = tmp_path / "bad.npy"
    bad.write_text("not numpy")
    with pytest.raises(DataError, match="bad.npy"):
        read_token_file(str(bad))


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


# --- launch/prepare_data.py --------------------------------------------------


def _prepare_data_module():
    spec = importlib.util.spec_from_file_location(
        "prepare_data", os.path.join(REPO, "launch", "prepare_data.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_data_writes_split_token_files_and_is_then_up_to_date(
    tmp_path, monkeypatch, capsys
):
    prep = _prepare_data_module()
    docs = {"a": synthetic_documents(30, seed=1), "b": synthetic_documents(20, seed=2)}
    monkeypatch.setattr(
        prep, "default_sources", lambda: [(k, lambda v=v: iter(v)) for k, v in docs.items()]
    )
    out = str(tmp_path / "data")
    args = ["--out", out, "--vocab-size", "320", "--valid-fraction", "0.1"]
    assert prep.main(args) == 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    tok = Tokenizer(os.path.join(out, "tokenizer.model"))
    assert meta["tokenizer_identity"] == tok.identity and meta["eod_id"] == tok.eod_id
    assert meta["per_source"]["valid"]["a"]["documents"] == 3
    assert meta["per_source"]["valid"]["b"]["documents"] == 2
    train, valid = (
        read_token_file(os.path.join(out, "train.npy")),
        read_token_file(os.path.join(out, "valid.npy")),
    )
    assert (len(train), len(valid)) == (meta["tokens"]["train"], meta["tokens"]["valid"])
    assert int((train == tok.eod_id).sum()) + int((valid == tok.eod_id).sum()) == 50
    # Every document comes back, exactly once, from one of the two splits.
    text = tok.decode(train.tolist()) + tok.decode(valid.tolist())
    assert sorted(text) == sorted("".join(docs["a"] + docs["b"]))
    capsys.readouterr()
    assert prep.main(args) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad",
    [
        ["--vocab-size", "0"],
        ["--model-type", "word"],
        ["--valid-fraction", "0"],
        ["--vocab-size", "x"],
    ],
)
def test_prepare_data_bad_arguments_print_one_error_line_and_exit_2(tmp_path, capsys, bad):
    prep = _prepare_data_module()
    assert prep.main(["--out", str(tmp_path / "d")] + bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "d")


def test_prepare_data_out_path_that_is_a_file_is_an_error(tmp_path, capsys):
    prep = _prepare_data_module()
    (tmp_path / "f").write_text("")
    assert prep.main(["--out", str(tmp_path / "f")]) == 2
    assert "not a directory" in capsys.readouterr().err
