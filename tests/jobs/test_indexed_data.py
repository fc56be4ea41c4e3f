"""Issue 50 items 1-2 without a training run: the model's tokenizer read from disk (HF ``tokenizers`` JSON, tiktoken
BPE), Megatron indexed datasets read against an independent writer of the published layout, ``moonrt data build``,
the tokenized-corpus cache (rank 0 builds, the other ranks wait), and blend proportions and determinism."""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from dist import dist_run
from jobs.helpers import TEXT, _cli, hf_tokenizer

from moonrt.jobs.train import blend, data, indexed, tokenized
from moonrt.jobs.train.config import BlendEntry, DataConfig
from moonrt.jobs.train.tokenizer import TokenizerError, check_vocab, load_tokenizer


def tiktoken_file(path: Path, specials: dict[int, str] | None = None) -> Path:
    """A tiktoken BPE file: the 256 bytes, then merges ``th``, ``the``, ``he`` (ranks 256-258); ``specials`` in a
    ``tokenizer_config.json`` beside it (the Hugging Face ``added_tokens_decoder`` form)."""
    merges = [b"th", b"he", b"the"]
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines += [f"{base64.b64encode(m).decode()} {256 + i}" for i, m in enumerate(merges)]
    path.write_text("\n".join(lines) + "\n")
    if specials:
        cfg = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in specials.items()}}
        (path.parent / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


# ---- 1. tokenizers ------------------------------------------------------------------------------------------------

def test_hf_tokenizer_from_disk(tmp_path: Path) -> None:
    import tokenizers

    path = hf_tokenizer(tmp_path / "tok.json")
    tok = load_tokenizer(str(path))
    ref = tokenizers.Tokenizer.from_file(str(path))
    assert tok.kind == "hf" and tok.vocab_size == 256
    assert tok.encode("def f12(x): return x") == ref.encode("def f12(x): return x", add_special_tokens=False).ids
    eos = ref.token_to_id("<eos>")
    assert eos not in tok.encode("a <eos> b")  # special-token text in a corpus stays text
    check_vocab(tok, 256, "k3_tiny")
    with pytest.raises(TokenizerError, match=r"^data\.tokenizer \(--tokenizer\) = .*vocabulary of 256 tokens, the "
                                             r"model's \(k3_tiny\) is 512"):
        check_vocab(tok, 512, "k3_tiny")
    check_vocab(tok, 256, "x")  # padded to a multiple of 128 (Megatron) is the same vocabulary: 256 already is


def test_tiktoken_file_with_special_tokens(tmp_path: Path) -> None:
    import tiktoken

    path = tiktoken_file(tmp_path / "tiktoken.model", specials={259: "<|eos|>", 260: "<|bos|>"})
    tok = load_tokenizer(str(path))
    assert tok.kind == "tiktoken" and tok.vocab_size == 261
    ids = tok.encode("the theme")
    assert ids[0] == 258 and bytes(ids[1:2]) == b" "  # "the" merged, then " " (a byte rank)
    ranks = {bytes([b]): b for b in range(256)} | {b"th": 256, b"he": 257, b"the": 258}
    ref = tiktoken.Encoding("ref", pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+""",
                            mergeable_ranks=ranks, special_tokens={"<|eos|>": 259})
    assert ref.decode(tok.encode("x <|eos|> the")) == "x <|eos|> the"  # the special's text encoded as text
    assert 259 not in tok.encode("x <|eos|> the")
    # the specials' config is part of the identity (a changed config is another cache key)
    other = load_tokenizer(str(tiktoken_file(tmp_path / "tiktoken.model", specials={259: "<|eos|>"})))
    assert other.sha256 != tok.sha256 and other.vocab_size == 260


@pytest.mark.parametrize("name,what", [("moonshotai/Kimi-K2-Instruct", "looks like a Hugging Face hub name"),
                                       ("no/such/dir/tok.json", "no such file"),
                                       (".", "not a regular file")])
def test_tokenizer_path_refused_offline(name: str, what: str) -> None:
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(name)
    assert str(err.value).startswith(f"data.tokenizer (--tokenizer) = {name!r}: ") and what in str(err.value)
    assert "\n" not in str(err.value)


def test_not_a_tokenizer_and_missing_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.model"
    bad.write_text("hello world again\n")
    with pytest.raises(TokenizerError, match="line 1 is not 'base64-token rank'"):
        load_tokenizer(str(bad))
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizers JSON file"):
        load_tokenizer(str(bad))
    path = tiktoken_file(tmp_path / "t.model")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails as if not installed
    with pytest.raises(TokenizerError, match=r"needs the 'tiktoken' package, which is not installed"):
        load_tokenizer(str(path))


# ---- 2. Megatron indexed datasets -------------------------------------------------------------------------------

def megatron_files(prefix: Path, docs: list[list[list[int]]], code: int, np_dtype: str) -> None:
    """An independent writer from Megatron-LM's published layout (``_IndexWriter``): ``docs`` is a list of
    documents, each a list of sequences (several sequences per document, as Megatron's sentence-split data has)."""
    seqs = [s for d in docs for s in d]
    with open(str(prefix) + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.array(s, dtype=np_dtype).tobytes())
    itemsize = np.dtype(np_dtype).itemsize
    pointers, at = [], 0
    for s in seqs:
        pointers.append(at)
        at += len(s) * itemsize
    doc_idx = [0]
    for d in docs:
        doc_idx.append(doc_idx[-1] + len(d))
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(seqs)}i", *[len(s) for s in seqs]))
        f.write(struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


@pytest.mark.parametrize("code,np_dtype", [(8, "<u2"), (4, "<i4")])
def test_reader_against_megatron_layout(tmp_path: Path, code: int, np_dtype: str) -> None:
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 250, size=int(rng.integers(1, 9))).tolist() for _ in range(int(rng.integers(1, 4)))]
            for _ in range(12)]
    docs.insert(3, [[]])  # an empty document (one empty sequence): no start of its own
    megatron_files(tmp_path / "ds", docs, code, np_dtype)
    tokens, starts = indexed.read_indexed(tmp_path / "ds")
    flat = [t for d in docs for s in d for t in s]
    assert tokens.dtype == np.dtype(np_dtype) and tokens.tolist() == flat
    want, at = [], 0
    for d in docs:
        n = sum(len(s) for s in d)
        if n:
            want.append(at)
        at += n
    assert starts.tolist() == want
    # the writer writes what the independent writer writes, byte for byte (one sequence per document)
    one = [[sum(d, [])] for d in docs]
    megatron_files(tmp_path / "ref", one, code, np_dtype)
    indexed.write_indexed(tmp_path / "mine", [np.array(d[0]) for d in one], np_dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"mine{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes(), ext


def _corrupt(prefix: Path, offset: int, data_: bytes) -> None:
    b = bytearray(Path(str(prefix) + ".idx").read_bytes())
    b[offset:offset + len(data_)] = data_
    Path(str(prefix) + ".idx").write_bytes(bytes(b))


@pytest.mark.parametrize("damage,msg", [
    (lambda p: _corrupt(p, 0, b"XXIDIDX"), "not a Megatron index"),
    (lambda p: _corrupt(p, 9, struct.pack("<Q", 2)), "version 2, expected 1"),
    (lambda p: _corrupt(p, 17, bytes([7])), "dtype code 7 (float32)"),
    (lambda p: _corrupt(p, 18, struct.pack("<Q", 10**12)), "bytes for 1000000000000 sequences"),
    (lambda p: Path(str(p) + ".bin").write_bytes(b"\0" * 6), "6 bytes, expected 8"),
    (lambda p: _corrupt(p, 34 + 8 + 8, struct.pack("<q", 5)), "sequence 1 at byte 5"),
])
def test_malformed_index_is_one_line(tmp_path: Path, damage, msg: str) -> None:
    megatron_files(tmp_path / "ds", [[[1, 2]], [[3, 4]]], 8, "<u2")
    damage(tmp_path / "ds")
    with pytest.raises(ValueError) as err:
        indexed.read_indexed(tmp_path / "ds")
    assert msg in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_indexed_corpus_documents_and_pack(tmp_path: Path) -> None:
    """``--corpus PREFIX`` reads the index's documents: ``pack_documents`` needs no eos_id; windows never train a
    target across a document boundary of the index."""
    docs = [list(range(i, i + 20 + 3 * i)) for i in range(10)]
    megatron_files(tmp_path / "ds", [[d] for d in docs], 8, "<u2")
    cfg = DataConfig(corpus=str(tmp_path / "ds"), pack_documents=True)
    cfg.validate()
    corpus = data.load_corpus(str(tmp_path / "ds"), None, 256, 0.2)
    assert corpus.description.startswith(f"{tmp_path / 'ds'} (indexed, uint16")
    bounds = np.cumsum([0] + [len(d) for d in docs])[:-1]
    assert corpus.train_docs.tolist() == [b for b in bounds if b < len(corpus.train)]
    batch, ids = data.packed_batch(corpus.train, corpus.train_docs, 0, 3, 4, 16)
    x, y, _ = data.shard_packed(batch, ids)
    for row, start in enumerate(data._batch_starts(corpus.train, 0, 3, 4, 16)):
        for t in range(16):
            crosses = any(start + t < b <= start + t + 1 for b in bounds)
            assert (y[row, t] == data.IGNORE_INDEX) == crosses
    with pytest.raises(ValueError, match="token id 55 >= model vocab_size 50"):
        data.load_corpus(str(tmp_path / "ds"), None, 50, 0.2)


# ---- moonrt data build and the cache ------------------------------------------------------------------------------

def test_data_build_cli(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    tok_path = hf_tokenizer(tmp_path / "tok.json")
    (tmp_path / "a.txt").write_text(TEXT[:2000])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": TEXT[i:i + 300]}) for i in (0, 500, 900)) + "\n")
    code, out, err = _cli(["data", "build", "--tokenizer", str(tok_path), "--input", str(tmp_path / "a.txt"),
                           str(tmp_path / "b.jsonl"), "--output", str(tmp_path / "ds")], capfd)
    assert code == 0, err
    assert "4 documents" in out
    tok = load_tokenizer(str(tok_path))
    tokens, starts = indexed.read_indexed(tmp_path / "ds")
    want = [tok.encode(TEXT[:2000])] + [tok.encode(TEXT[i:i + 300]) for i in (0, 500, 900)]
    assert tokens.tolist() == sum(want, []) and tokens.dtype == np.uint16
    assert starts.tolist() == np.cumsum([0] + [len(w) for w in want])[:-1].tolist()
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "ds.bin").stat().st_mode & 0o777 == 0o666 & ~mask
    before = (tmp_path / "ds.idx").read_bytes()
    code, _, err = _cli(["data", "build", "--tokenizer", str(tok_path), "--input", str(tmp_path / "a.txt"),
                         "--output", str(tmp_path / "ds")], capfd)
    assert code == 2 and err.count("\n") == 1 and "exists; expected a new prefix" in err
    assert (tmp_path / "ds.idx").read_bytes() == before
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    code, _, err = _cli(["data", "build", "--tokenizer", str(tok_path), "--input", str(tmp_path / "bad.jsonl"),
                         "--output", str(tmp_path / "bad")], capfd)
    assert code == 2 and err.count("\n") == 1 and "line 1: expected a JSON object with a string 'text'" in err
    assert not list(tmp_path.glob("bad.*[bx]")) and not list(tmp_path.glob(".bad*"))  # nothing half-written left


def test_cache_built_once_and_reused(tmp_path: Path) -> None:
    tok = load_tokenizer(str(hf_tokenizer(tmp_path / "tok.json")))
    (tmp_path / "c.txt").write_text(TEXT)
    prefix, built = tokenized.cached(tok, str(tmp_path / "c.txt"), tmp_path / "cache", True, lambda f: f)
    assert built and indexed.read_indexed(prefix)[0].tolist() == tok.encode(TEXT)
    stamp = os.stat(str(prefix) + ".idx").st_mtime_ns
    again, built = tokenized.cached(tok, str(tmp_path / "c.txt"), tmp_path / "cache", True, lambda f: f)
    assert again == prefix and not built and os.stat(str(prefix) + ".idx").st_mtime_ns == stamp
    (tmp_path / "c.txt").write_text(TEXT + "more text\n")  # a changed corpus is another cache entry
    changed, built = tokenized.cached(tok, str(tmp_path / "c.txt"), tmp_path / "cache", True, lambda f: f)
    assert built and changed != prefix


def _cache_on_ranks(rank: int, world: int, tok_path: str, corpus: str, cache: str) -> tuple[str, bool, list[int]]:
    import torch.distributed as dist

    def agree(flag: bool) -> bool:
        t = __import__("torch").tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    tok = load_tokenizer(tok_path)
    prefix, built = tokenized.cached(tok, corpus, cache, rank == 0, agree)
    return str(prefix), built, indexed.read_indexed(prefix)[0][:50].tolist()


def _cache_fails_on_rank0(rank: int, world: int, tok_path: str, corpus: str, cache: str) -> str:
    import torch
    import torch.distributed as dist

    def agree(flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    try:
        tokenized.cached(load_tokenizer(tok_path), corpus, cache, rank == 0, agree)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_cache_rank0_builds_others_wait(tmp_path: Path) -> None:
    tok_path = hf_tokenizer(tmp_path / "tok.json")
    (tmp_path / "c.txt").write_text(TEXT)
    got = dist_run(_cache_on_ranks, 2, str(tok_path), str(tmp_path / "c.txt"), str(tmp_path / "cache"), timeout=120)
    assert got[0][1] and not got[1][1]  # rank 0 built it, rank 1 read it after
    assert got[0][0] == got[1][0] and got[0][2] == got[1][2] == load_tokenizer(str(tok_path)).encode(TEXT)[:50]
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "cache").write_text("a file where the cache directory would go")
    errs = dist_run(_cache_fails_on_rank0, 2, str(tok_path), str(tmp_path / "c.txt"), str(tmp_path / "ro" / "cache"),
                    timeout=120)
    assert errs[0].startswith("data.cache_dir = ") and "cannot write the tokenized corpus" in errs[0]
    assert errs[1].startswith("data.tokenizer: rank 0 could not tokenize corpus")


# ---- blending ---------------------------------------------------------------------------------------------------

def _blend(sizes: list[int], weights: list[float]) -> blend.Blend:
    corpora = tuple(data.Corpus(train=np.full(n, k, dtype=np.uint16), heldout=np.full(64, k, dtype=np.uint16),
                                vocab_size=256, description=f"c{k}") for k, n in enumerate(sizes))
    w = np.array(weights)
    return blend.Blend(corpora=corpora, p=w / w.sum())


def test_blend_proportions_within_binomial_bound() -> None:
    """Each row's corpus is an independent draw with probability p_k, so over N = steps x B rows the count from
    corpus k is Binomial(N, p_k): within 4 standard deviations sqrt(N p (1 - p)) of N p (a false failure has
    probability < 1e-4 per corpus), whatever the corpora's sizes (sizes differ 100-fold here)."""
    mix = _blend([200, 20_000, 2_000], [0.5, 0.3, 0.2])
    steps, b = 400, 8
    counts = np.zeros(3)
    for step in range(steps):
        batch, _ = blend.batch(mix, 7, step, b, 16)
        counts += np.bincount(batch[:, 0], minlength=3)  # corpus k's tokens are all k
    n = steps * b
    for k, p in enumerate(mix.p):
        assert abs(counts[k] - n * p) <= 4 * np.sqrt(n * p * (1 - p)), (k, counts, n * p)


def test_blend_batch_is_a_function_of_seed_and_step() -> None:
    mix = _blend([500, 700], [1.0, 3.0])
    a = [blend.batch(mix, 3, s, 4, 8)[0] for s in range(5)]
    b = [blend.batch(mix, 3, s, 4, 8)[0] for s in reversed(range(5))][::-1]  # another order: the same batches
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(blend.batch(mix, 4, 0, 4, 8)[0], a[0])
    assert blend.eval_counts(np.array([0.25, 0.75]), 10).tolist() == [3, 7]
    assert blend.eval_counts(np.array([1 / 3] * 3), 4).sum() == 4


def test_blend_config_checked() -> None:
    from moonrt.config import ConfigError

    with pytest.raises(ConfigError, match=r"^data\.blend\[1\]\.weight = -1\.0: expected a finite number > 0"):
        DataConfig(blend=[BlendEntry(path="a"), BlendEntry(path="b", weight=-1.0)]).validate()
    with pytest.raises(ConfigError, match=r"^data\.blend = .*null when data\.corpus"):
        DataConfig(corpus="x", blend=[BlendEntry(path="a")]).validate()
    with pytest.raises(ConfigError, match=r"^data\.tokenizer = 't\.json': expected null with data\.token_dtype"):
        DataConfig(corpus="x", token_dtype="uint16", tokenizer="t.json").validate()
