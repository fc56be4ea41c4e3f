"""Text tokenized once into a Megatron indexed dataset: ``moonrt data build`` and the ``--corpus`` cache.

Documents: a ``.jsonl`` input holds one document per line (its ``"text"`` field, Megatron's
``preprocess_data.py`` input); any other input file is one document. Text is read and tokenized a bounded chunk
of whole lines at a time (:data:`CHUNK_BYTES`), so a corpus larger than memory is tokenized in bounded memory (a
pre-tokenizer match never spans a chunk's last newline).

The cache (``moonrt train --tokenizer T --corpus FILE``): ``CACHE_DIR/<name>.<key>.bin/.idx`` with ``key`` the
SHA-256 of the tokenizer file's digest and the corpus file's resolved path, size and modification time (a changed
corpus or tokenizer is tokenized again, under another name). Rank 0 builds it (each file created exclusively and
atomically, :func:`moonrt.jobs.train.indexed.write_indexed`); every rank then agrees on the outcome through one
collective (``agree``) before any other rank reads it, so the others wait for rank 0 and a failure on rank 0 stops
every rank. A resume finds the files and reads them (nothing tokenized again).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from moonrt.jobs.train import indexed
from moonrt.jobs.train.tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20
"""Text bytes (whole lines) tokenized at a time."""
MAX_LINE_BYTES = 64 * 2**20
"""Longest ``.jsonl`` line (one document) read."""


def _chunks(path: Path) -> Iterator[str]:
    """The UTF-8 text of ``path`` in chunks of whole lines of about :data:`CHUNK_BYTES`."""
    with open(path, "rb") as f:
        rest = b""
        while block := f.read(CHUNK_BYTES):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0 and len(block) < MAX_LINE_BYTES:
                rest = block
                continue
            cut = cut or len(block)
            rest = block[cut:]
            yield block[:cut].decode("utf-8", errors="replace")
        if rest:
            yield rest.decode("utf-8", errors="replace")


def documents(tok: Tokenizer, inputs: Iterable[str | Path]) -> Iterator[np.ndarray]:
    """Each document of ``inputs`` (see the module docstring) as a 1-D int64 token array."""
    for path in map(Path, inputs):
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for n, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                    if not line.strip():
                        continue
                    if len(line) > MAX_LINE_BYTES:
                        raise ValueError(f"input {str(path)!r} line {n}: longer than {MAX_LINE_BYTES} bytes "
                                         "(MAX_LINE_BYTES)")
                    try:
                        text = json.loads(line)["text"]
                        if not isinstance(text, str):
                            raise TypeError
                    except (ValueError, KeyError, TypeError):
                        raise ValueError(f"input {str(path)!r} line {n}: expected a JSON object with a string "
                                         "'text' field") from None
                    yield np.asarray(tok.encode(text), dtype=np.int64)
        else:
            yield np.concatenate([np.zeros(0, dtype=np.int64),
                                  *(np.asarray(tok.encode(c), dtype=np.int64) for c in _chunks(path))])


def build(tok: Tokenizer, inputs: list[str], prefix: str | Path) -> tuple[int, int]:
    """Tokenize ``inputs`` into ``PREFIX.bin/.idx`` (:func:`moonrt.jobs.train.indexed.write_indexed`, the dtype
    Megatron picks for the vocabulary). Returns ``(documents, tokens)``."""
    return indexed.write_indexed(prefix, documents(tok, inputs), indexed.dtype_for(tok.vocab_size))


def cache_prefix(tok: Tokenizer, corpus: str, cache_dir: str | Path) -> Path:
    """Where the tokenized ``corpus`` is cached (see the module docstring)."""
    st = os.stat(corpus)
    key = hashlib.sha256(f"{tok.sha256}\0{os.path.realpath(corpus)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return Path(cache_dir) / f"{Path(corpus).name}.{key.hexdigest()[:16]}"


def cached(tok: Tokenizer, corpus: str, cache_dir: str | Path, is_main: bool,
           agree: Callable[[bool], bool]) -> tuple[Path, bool]:
    """The indexed dataset of ``corpus`` tokenized by ``tok`` in ``cache_dir``: built by the main rank when absent.
    ``agree(failed)``: True on every rank when any rank failed (a collective every rank calls once). Returns
    ``(prefix, built)``; raises the main rank's error there and a ValueError naming it on the others."""
    prefix = cache_prefix(tok, corpus, cache_dir)
    bin_path, idx_path = indexed.paths(prefix)
    error: OSError | ValueError | None = None
    built = False
    if is_main and not idx_path.exists():
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            if bin_path.exists():  # a build killed between its two links: our own complete-or-not .bin, unindexed
                bin_path.unlink()
            build(tok, [corpus], prefix)
            built = True
        except (OSError, ValueError) as exc:
            error = exc
    if agree(error is not None):
        if error is not None:
            if isinstance(error, ValueError):
                raise error
            raise ValueError(f"data.cache_dir = {str(cache_dir)!r}: cannot write the tokenized corpus "
                             f"({error.strerror or error})") from None
        raise ValueError(f"data.tokenizer: rank 0 could not tokenize corpus {corpus!r} into {str(cache_dir)!r} "
                         "(its error is on rank 0's output)")
    return prefix, built
