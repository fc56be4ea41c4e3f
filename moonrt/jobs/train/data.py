"""Training data for ``moonrt train``: byte tokenizer, corpora, deterministic global batches.

Design (so data parallelism, expert parallelism and context parallelism never change what is trained):

- A corpus is two 1-D token arrays, ``train`` and ``heldout`` (numpy; a memory map for token files).
- The **global batch** of optimizer step ``s`` is a pure function of ``(seed, s)``: ``batch_size``
  windows of ``seq_len + 1`` tokens at offsets drawn by ``numpy.random.default_rng([seed, s])``.
  It never depends on the parallel layout, on how many steps ran before, or on a resume.
- A rank takes its part by index arithmetic only (:func:`shard`): rows ``[r*B/d, (r+1)*B/d)`` for
  data rank ``r`` of ``d``, and the contiguous sequence slice ``[c*T//n, (c+1)*T//n)`` for context
  rank ``c`` of ``n`` (the split KCP uses).

Corpora:

- default (no ``--corpus``): the Python standard library's own top-level ``*.py`` sources (always
  present offline), in sorted file order, byte-tokenized; every 16th file (index % 16 == 15) is
  held out, so held-out text is unseen files, not a tail of a seen one;
- a text file: UTF-8 bytes read with ``numpy.memmap`` (never whole into memory: a corpus may be larger than it),
  the last ``heldout_fraction`` of bytes held out;
- a binary token file (``uint16`` or ``uint32``, native byte order) read with ``numpy.memmap``,
  the last ``heldout_fraction`` of tokens held out;
- a Megatron indexed dataset (``PREFIX`` of ``PREFIX.bin`` / ``PREFIX.idx``, :mod:`moonrt.jobs.train.indexed`),
  memory-mapped, its documents from the index; text tokenized by a model's tokenizer is cached in this form
  (:mod:`moonrt.jobs.train.tokenized`). Several corpora are blended by weight in :mod:`moonrt.jobs.train.blend`.

Document packing (``data.pack_documents``, Megatron's ``reset_attention_mask`` / ``eod_mask_loss`` form): the
windows stay the same random cuts of the concatenated documents (so a window holds several documents, the
first possibly a suffix), and :func:`packed_batch` also yields every token's document index, from the corpus's
document starts (the stdlib corpus: its files; a user corpus: the token after each ``eos_id``, the EOS token
ending its document). The model then keeps documents apart (:mod:`moonrt.parallel.packing`), and
:func:`shard_packed` masks (:data:`IGNORE_INDEX`) each target that starts a new document: it would be predicted
from the previous document's last token, which is no context for it. Megatron does the same with
``eod_mask_loss`` (the loss at an EOD input is dropped); torchtitan does not mask, but its documents carry
BOS/EOS tokens, so its cross-document target is always BOS. Byte corpora have no BOS, so the target would be
real text predicted across the boundary: masked here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import sysconfig
from pathlib import Path
from typing import Literal

import numpy as np

TokenDtype = Literal["uint16", "uint32"]

IGNORE_INDEX = -100
"""Target value the loss skips (torch's ``cross_entropy`` default ``ignore_index``): cross-document targets."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, ``vocab_size = 256``, lossless on any text."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``[N]`` uint8 token ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Token ids -> text (invalid UTF-8 sequences replaced)."""
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """``train [N]`` and ``heldout [M]`` token arrays (integer dtype), their vocabulary and a description;
    ``train_docs`` / ``heldout_docs``: sorted int64 start offsets of the documents in each split (first 0), or
    None where document boundaries are unknown."""

    train: np.ndarray
    heldout: np.ndarray
    vocab_size: int
    description: str
    train_docs: np.ndarray | None = None
    heldout_docs: np.ndarray | None = None


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))


def stdlib_corpus(heldout_every: int = 16) -> Corpus:
    """The default corpus: byte-tokenized stdlib sources, files ``i % heldout_every == heldout_every - 1`` held out."""
    files = stdlib_files()
    if len(files) < heldout_every:
        raise ValueError(f"standard library at {sysconfig.get_paths()['stdlib']!r}: found {len(files)} .py files, "
                         f"expected at least {heldout_every}")
    train: list[bytes] = []
    held: list[bytes] = []
    for i, f in enumerate(files):
        (held if i % heldout_every == heldout_every - 1 else train).append(f.read_bytes())

    def starts(parts: list[bytes]) -> np.ndarray:  # each file a document (empty files add none)
        return np.unique(np.concatenate([[0], np.cumsum([len(b) for b in parts])[:-1]]).astype(np.int64))

    return Corpus(
        train=np.frombuffer(b"".join(train), dtype=np.uint8),
        heldout=np.frombuffer(b"".join(held), dtype=np.uint8),
        vocab_size=ByteTokenizer.vocab_size,
        description=f"Python {sysconfig.get_python_version()} stdlib sources ({len(files)} files, bytes)",
        train_docs=starts(train), heldout_docs=starts(held),
    )


CHUNK_TOKENS = 1 << 22
"""Tokens a whole-corpus pass (document starts, unigram counts) reads at a time, so that its temporaries stay
a few tens of MiB (4 Mi tokens: 32 MiB as int64) however large the memory-mapped corpus is."""


def eos_document_starts(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Start offsets (int64, first 0) of the documents in ``tokens [N]`` where each ``eos_id`` token ends one."""
    n = len(tokens)
    parts = [np.zeros(1, dtype=np.int64)]
    for lo in range(0, n, CHUNK_TOKENS):
        ends = np.flatnonzero(np.asarray(tokens[lo:lo + CHUNK_TOKENS]) == eos_id).astype(np.int64) + (lo + 1)
        parts.append(ends[ends < n])
    return np.concatenate(parts)


def _split(tokens: np.ndarray, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction = {heldout_fraction!r}: expected a number in (0, 1)")
    cut = len(tokens) - max(1, int(len(tokens) * heldout_fraction))
    return tokens[:cut], tokens[cut:]


def text_corpus(path: str | Path, heldout_fraction: float = 0.05) -> Corpus:
    """A UTF-8 text file, byte-tokenized, memory-mapped (pages are read as windows touch them, never the whole file
    into memory); the last ``heldout_fraction`` of bytes held out."""
    path = Path(path)
    # np.memmap cannot map an empty file; an empty corpus is refused later (_check_length), as before
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, dtype=np.uint8)
    train, held = _split(data, heldout_fraction)
    return Corpus(train=train, heldout=held, vocab_size=ByteTokenizer.vocab_size, description=f"{path} (bytes)")


def token_corpus(path: str | Path, dtype: TokenDtype, vocab_size: int, heldout_fraction: float = 0.05) -> Corpus:
    """A binary token file (``uint16``/``uint32``) read with a memory map; ids must be ``< vocab_size``."""
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"token_dtype = {dtype!r}: expected 'uint16' or 'uint32'")
    path = Path(path)
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0 or size % itemsize:
        raise ValueError(f"corpus {str(path)!r}: {size} bytes is not a positive multiple of {itemsize} ({dtype})")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    top = int(tokens.max())
    if top >= vocab_size:
        raise ValueError(f"corpus {str(path)!r}: token id {top} >= model vocab_size {vocab_size}")
    train, held = _split(tokens, heldout_fraction)
    return Corpus(train=train, heldout=held, vocab_size=vocab_size, description=f"{path} ({dtype} tokens)")


def indexed_corpus(prefix: str | Path, vocab_size: int, heldout_fraction: float = 0.05) -> Corpus:
    """A Megatron indexed dataset (``PREFIX.bin/.idx``, :func:`moonrt.jobs.train.indexed.read_indexed`), memory-mapped,
    its documents from the index; the last ``heldout_fraction`` of tokens held out (the document cut there starts the
    held-out split). Ids must be ``< vocab_size``."""
    from moonrt.jobs.train import indexed

    tokens, docs = indexed.read_indexed(prefix)
    top = max(int(np.asarray(tokens[lo:lo + CHUNK_TOKENS]).max()) for lo in range(0, len(tokens), CHUNK_TOKENS))
    if top >= vocab_size:
        raise ValueError(f"corpus {str(prefix)!r}: token id {top} >= model vocab_size {vocab_size}")
    train, held = _split(tokens, heldout_fraction)
    cut = len(train)
    return Corpus(train=train, heldout=held, vocab_size=vocab_size,
                  description=f"{prefix} (indexed, {tokens.dtype.name} tokens, {len(docs)} documents)",
                  train_docs=docs[docs < cut], heldout_docs=np.concatenate([[0], docs[docs > cut] - cut]))


def load_corpus(path: str | None, token_dtype: TokenDtype | None, vocab_size: int,
                heldout_fraction: float = 0.05, eos_id: int | None = None) -> Corpus:
    """The corpus a job config names: None -> :func:`stdlib_corpus`; a token dtype -> :func:`token_corpus`;
    otherwise :func:`text_corpus`. Raises ValueError if a byte corpus does not fit ``vocab_size``.

    ``eos_id`` (user corpora): the token (a byte value for a text file) that ends each document; sets the
    corpus's document starts (:func:`eos_document_starts`). The stdlib corpus's documents are its files."""
    if path is None:
        corpus = stdlib_corpus()
    elif indexed_prefix(path) is None and (what := _not_a_corpus_file(path)) is not None:
        kind = f"a {token_dtype} token file" if token_dtype is not None else "a UTF-8 text file"
        raise ValueError(f"corpus (--corpus) = {path!r}: {what}; expected an existing file ({kind})")
    elif token_dtype is not None:
        corpus = token_corpus(path, token_dtype, vocab_size, heldout_fraction)
    elif (prefix := indexed_prefix(path)) is not None:
        corpus = indexed_corpus(prefix, vocab_size, heldout_fraction)
    else:
        corpus = text_corpus(path, heldout_fraction)
    if corpus.vocab_size > vocab_size:
        raise ValueError(f"corpus {corpus.description}: needs vocab_size >= {corpus.vocab_size}, "
                         f"model has {vocab_size}")
    if eos_id is not None and path is not None:
        if not 0 <= eos_id < corpus.vocab_size:
            raise ValueError(f"eos_id (--eos-id) = {eos_id}: expected a token id in [0, {corpus.vocab_size}) "
                             f"of corpus {corpus.description}")
        corpus = dataclasses.replace(corpus, train_docs=eos_document_starts(corpus.train, eos_id),
                                     heldout_docs=eos_document_starts(corpus.heldout, eos_id))
    return corpus


def indexed_prefix(path: str) -> Path | None:
    """The Megatron indexed-dataset prefix ``path`` names (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` beside a
    ``PREFIX.idx``), or None."""
    from moonrt.jobs.train.indexed import prefix_of

    return prefix_of(path)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "not a regular file (character device)"),
               (stat.S_ISBLK, "not a regular file (block device)"), (stat.S_ISFIFO, "not a regular file (FIFO)"),
               (stat.S_ISSOCK, "not a regular file (socket)"))


def _not_a_corpus_file(path: str) -> str | None:
    """Why ``path`` (a symlink followed) cannot be a corpus, or None for a non-empty regular file: missing, a
    directory, a character device (``/dev/null``), a block device, a FIFO, a socket, empty, unreadable. Only
    ``stat``: a FIFO is never opened (that would block)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    for test, what in _FILE_KINDS:
        if test(st.st_mode):
            return what
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size == 0:
        return "an empty file (0 bytes)"
    return None


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 2:
        raise ValueError(f"{what} has {len(tokens)} tokens: expected at least seq_len + 2 = {seq_len + 2}")


def global_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The global batch of optimizer step ``step``: ``[batch_size, seq_len + 1]`` int64 windows.

    A pure function of ``(seed, step)`` (and the corpus): the same on every rank and layout.
    Inputs are ``[:, :-1]``, next-token targets ``[:, 1:]``.
    """
    return _windows(tokens, _batch_starts(tokens, seed, step, batch_size, seq_len), seq_len)


def _batch_starts(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    _check_length(tokens, seq_len, "training split")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)


def _eval_starts(tokens: np.ndarray, num: int, seq_len: int) -> np.ndarray:
    _check_length(tokens, seq_len, "held-out split")
    return np.linspace(0, len(tokens) - seq_len - 1, num=num).astype(np.int64)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    return np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])


def eval_windows(tokens: np.ndarray, num: int, seq_len: int) -> np.ndarray:
    """``num`` evenly spaced held-out windows ``[num, seq_len + 1]`` int64 (the same every eval)."""
    return _windows(tokens, _eval_starts(tokens, num, seq_len), seq_len)


def document_ids(doc_starts: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``[len(starts), seq_len + 1]`` int64: the corpus document index of every token of the windows at
    ``starts`` (``doc_starts``: sorted document start offsets, first 0)."""
    pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    return np.searchsorted(doc_starts, pos, side="right").astype(np.int64) - 1


def packed_batch(tokens: np.ndarray, doc_starts: np.ndarray, seed: int, step: int, batch_size: int,
                 seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`global_batch` (the same windows) and each token's document index ``[batch_size, seq_len + 1]``."""
    starts = _batch_starts(tokens, seed, step, batch_size, seq_len)
    return _windows(tokens, starts, seq_len), document_ids(doc_starts, starts, seq_len)


def packed_eval_windows(tokens: np.ndarray, doc_starts: np.ndarray, num: int,
                        seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`eval_windows` and each token's document index ``[num, seq_len + 1]``."""
    starts = _eval_starts(tokens, num, seq_len)
    return _windows(tokens, starts, seq_len), document_ids(doc_starts, starts, seq_len)


def shard_packed(batch: np.ndarray, docs: np.ndarray, dp_rank: int = 0,
                 dp_size: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's ``(inputs [B/d, T], targets [B/d, T], doc_ids [B/d, T])`` of a packed global batch
    (``batch``, ``docs`` ``[B, T + 1]`` from :func:`packed_batch`): :func:`shard`'s rows, with every target that
    starts another document than its input's set to :data:`IGNORE_INDEX` (see the module docstring)."""
    if docs.shape != batch.shape:
        raise ValueError(f"docs.shape = {docs.shape}: expected the batch's {batch.shape}")
    x, y = shard(batch, dp_rank, dp_size)
    d_in, d_out = shard(docs, dp_rank, dp_size)
    return x, np.where(d_in == d_out, y, IGNORE_INDEX), d_in


def packed_targets(docs: np.ndarray) -> int:
    """Targets the loss counts in a packed batch ``docs [B, T + 1]``: those in their input's document."""
    return int((docs[:, 1:] == docs[:, :-1]).sum())


def shard(batch: np.ndarray, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0,
          cp_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``(inputs [B/d, T_c], targets [B/d, T_c])`` of a global ``batch [B, T + 1]``.

    Rows ``[dp_rank*B/d, (dp_rank+1)*B/d)``; sequence slice ``[c*T//n, (c+1)*T//n)`` with
    ``c = cp_rank``, ``n = cp_size``. ``B`` must be divisible by ``dp_size`` and ``T >= cp_size``.
    """
    b, t1 = batch.shape
    t = t1 - 1
    if not 0 <= dp_rank < dp_size or b % dp_size:
        raise ValueError(f"dp_rank/dp_size = {dp_rank}/{dp_size}: expected 0 <= rank < size dividing batch {b}")
    if not 0 <= cp_rank < cp_size or t < cp_size:
        raise ValueError(f"cp_rank/cp_size = {cp_rank}/{cp_size}: expected 0 <= rank < size <= seq_len {t}")
    rows = slice(dp_rank * b // dp_size, (dp_rank + 1) * b // dp_size)
    cols = slice(cp_rank * t // cp_size, (cp_rank + 1) * t // cp_size)
    return batch[rows, :-1][:, cols], batch[rows, 1:][:, cols]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the empirical unigram distribution of ``tokens`` in nats/token.

    The loss of the best context-free predictor of this very text: a model that beats it uses context.
    """
    counts = np.zeros(vocab_size, dtype=np.float64)
    for lo in range(0, len(tokens), CHUNK_TOKENS):  # in chunks: an int64 copy of a memory-mapped split may not fit
        chunk = np.bincount(np.asarray(tokens[lo:lo + CHUNK_TOKENS], dtype=np.int64), minlength=vocab_size)
        if len(chunk) > len(counts):
            counts = np.concatenate([counts, np.zeros(len(chunk) - len(counts))])
        counts[:len(chunk)] += chunk
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum()) if len(p) else math.nan
