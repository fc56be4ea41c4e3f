"""moonrt.jobs.train.data: tokenizer, corpora, deterministic global batches and layout-independent shards."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moonrt.jobs.train import data


def test_byte_tokenizer_roundtrip() -> None:
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return 'héllo' + x  # ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text


def test_stdlib_corpus_is_deterministic_and_split_by_file() -> None:
    files = data.stdlib_files()
    assert files == sorted(files) and len(files) >= 16
    a, b = data.stdlib_corpus(), data.stdlib_corpus()
    assert np.array_equal(a.train, b.train) and np.array_equal(a.heldout, b.heldout)
    held = b"".join(f.read_bytes() for i, f in enumerate(files) if i % 16 == 15)
    assert a.heldout.tobytes() == held
    assert len(a.train) + len(a.heldout) == sum(f.stat().st_size for f in files)
    assert 2.0 < data.unigram_entropy(a.heldout, 256) < math.log(256)


def test_global_batch_depends_only_on_seed_and_step() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    b1 = data.global_batch(tokens, 3, 7, 8, 32)
    assert b1.shape == (8, 33) and b1.dtype == np.int64
    assert np.array_equal(b1, data.global_batch(tokens, 3, 7, 8, 32))
    assert not np.array_equal(b1, data.global_batch(tokens, 3, 8, 8, 32))
    assert not np.array_equal(b1, data.global_batch(tokens, 4, 7, 8, 32))
    assert np.array_equal(b1[:, 1:] - b1[:, :-1], np.ones((8, 32)))  # contiguous windows


@pytest.mark.parametrize("dp,cp", [(1, 1), (2, 1), (1, 3), (4, 2)])
def test_shards_tile_the_global_batch(dp: int, cp: int) -> None:
    batch = data.global_batch(np.arange(5_000, dtype=np.uint16), 0, 0, 8, 30)
    rows = []
    for d in range(dp):
        cols_x, cols_y = [], []
        for c in range(cp):
            x, y = data.shard(batch, d, dp, c, cp)
            cols_x.append(x)
            cols_y.append(y)
        rows.append((np.concatenate(cols_x, 1), np.concatenate(cols_y, 1)))
    assert np.array_equal(np.concatenate([r[0] for r in rows]), batch[:, :-1])
    assert np.array_equal(np.concatenate([r[1] for r in rows]), batch[:, 1:])


def test_token_and_text_corpora(tmp_path) -> None:
    toks = (np.arange(4_000) % 1000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    toks.tofile(path)
    c = data.load_corpus(str(path), "uint16", 1000, 0.1)
    assert isinstance(c.train, np.memmap)
    assert np.array_equal(np.concatenate([c.train, c.heldout]), toks) and len(c.heldout) == 400
    with pytest.raises(ValueError, match="token id 999 >= model vocab_size 500"):
        data.load_corpus(str(path), "uint16", 500)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="multiple of 2"):
        data.token_corpus(odd, "uint16", 1000)
    txt = tmp_path / "t.txt"
    txt.write_text("hello world " * 100)
    t = data.load_corpus(str(txt), None, 256, 0.5)
    assert t.heldout.tobytes() == txt.read_bytes()[600:]
    with pytest.raises(ValueError, match="expected an existing file"):
        data.load_corpus(str(tmp_path / "missing.txt"), None, 256)
    with pytest.raises(ValueError, match="needs vocab_size >= 256"):
        data.load_corpus(str(txt), None, 100)


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least seq_len \\+ 2"):
        data.global_batch(np.arange(10), 0, 0, 2, 16)
    batch = np.zeros((6, 9), dtype=np.int64)
    with pytest.raises(ValueError, match="dp_rank/dp_size = 0/4"):
        data.shard(batch, 0, 4)
    with pytest.raises(ValueError, match="cp_rank/cp_size = 2/2"):
        data.shard(batch, 0, 1, 2, 2)
