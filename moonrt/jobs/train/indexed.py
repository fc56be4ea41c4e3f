"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): a reader and a writer of the published layout.

The layout (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter`` / ``_IndexReader``; all
integers little-endian):

``PREFIX.idx``::

    9 bytes   header     b"MMIDIDX\\x00\\x00"
    u64       version    1
    u8        dtype code 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    u64       S          sequence count
    u64       D          document-index count (documents + 1)
    i32 [S]   sequence lengths (elements)
    i64 [S]   sequence pointers (byte offset of each sequence in PREFIX.bin)
    i64 [D]   document indices: document d is sequences [doc[d], doc[d+1]); doc[0] = 0, doc[-1] = S
    i8  [S]   sequence modes (multimodal datasets only; not read here)

``PREFIX.bin``: the sequences' elements, back to back, in the dtype.

:func:`read_indexed` memory-maps the ``.bin`` as one flat token array (the sequences must be stored back to back in
order, as Megatron's writer stores them) and returns each document's start offset in it, which is what
``--pack-documents`` needs. Every count and offset is checked against the file sizes before an array is mapped.
:func:`write_indexed` writes the layout, each file created exclusively (a temporary name, ``O_EXCL``, then a hard
link to its name: nothing existing is overwritten, a reader never sees a partial file; ``.bin`` before ``.idx``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
                                    4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.float64),
                                    7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
"""Megatron's ``DType`` codes."""
TOKEN_CODES = (1, 3, 4, 5, 8)
"""Codes of integer dtypes that can hold token ids (>= 0) and are read here."""
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # bytes before the arrays


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def prefix_of(path: str | Path) -> Path | None:
    """The indexed-dataset prefix that ``path`` names (``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` with
    ``PREFIX.idx`` present), or None when it names none."""
    s = str(path)
    for suffix in (".idx", ".bin"):
        if s.endswith(suffix) and Path(s[:-4] + ".idx").is_file():
            return Path(s[:-4])
    return Path(s) if not Path(s).exists() and Path(s + ".idx").is_file() else None


def dtype_for(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 for a vocabulary of at most 65,500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size <= 65500 else np.dtype(np.int32)


def read_indexed(prefix: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [N], doc_starts [docs])``: the ``.bin`` memory-mapped as one flat array and each document's start
    offset in it (int64, sorted, first 0; empty documents dropped). ValueError (one line naming the file) on a
    malformed index, a dtype that holds no token ids, sequences not stored back to back, or a ``.bin`` whose size
    disagrees."""
    bin_path, idx_path = paths(prefix)
    idx_size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(_FIXED)
    where = f"indexed dataset {str(idx_path)!r}"
    if len(head) < _FIXED or head[:len(HEADER)] != HEADER:
        raise ValueError(f"{where}: not a Megatron index (expected the header {HEADER!r} and {_FIXED} header bytes)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(HEADER):])
    if version != VERSION:
        raise ValueError(f"{where}: version {version}, expected {VERSION}")
    if code not in TOKEN_CODES:
        known = DTYPE_CODES.get(code)
        raise ValueError(f"{where}: dtype code {code} ({known if known is not None else 'unknown'}), expected one of "
                         + ", ".join(f"{c} ({DTYPE_CODES[c]})" for c in TOKEN_CODES))
    dtype = DTYPE_CODES[code]
    want = _FIXED + 12 * n_seq + 8 * n_doc
    if n_doc < 1 or idx_size not in (want, want + n_seq):
        raise ValueError(f"{where}: {idx_size} bytes for {n_seq} sequences and {n_doc} document indices, expected "
                         f"{want} (or {want + n_seq} with sequence modes)")
    lengths = np.fromfile(idx_path, dtype="<i4", count=n_seq, offset=_FIXED).astype(np.int64)
    pointers = np.fromfile(idx_path, dtype="<i8", count=n_seq, offset=_FIXED + 4 * n_seq)
    doc_idx = np.fromfile(idx_path, dtype="<i8", count=n_doc, offset=_FIXED + 12 * n_seq)
    if (lengths < 0).any():
        raise ValueError(f"{where}: negative sequence length at sequence {int(np.argmax(lengths < 0))}")
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # element offset of each sequence, and end
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        bad = int(np.argmax(pointers != starts[:-1] * dtype.itemsize))
        raise ValueError(f"{where}: sequence {bad} at byte {int(pointers[bad])}, expected "
                         f"{int(starts[bad]) * dtype.itemsize} (sequences stored back to back in order)")
    if doc_idx[0] != 0 or doc_idx[-1] != n_seq or (np.diff(doc_idx) < 0).any():
        raise ValueError(f"{where}: document indices must rise from 0 to the sequence count {n_seq}")
    bin_size = bin_path.stat().st_size
    if bin_size != int(starts[-1]) * dtype.itemsize:
        raise ValueError(f"indexed dataset {str(bin_path)!r}: {bin_size} bytes, expected "
                         f"{int(starts[-1]) * dtype.itemsize} ({int(starts[-1])} x {dtype})")
    if bin_size == 0:
        raise ValueError(f"indexed dataset {str(bin_path)!r}: holds no tokens")
    tokens = np.memmap(bin_path, dtype=dtype.newbyteorder("<"), mode="r")
    doc_starts = np.unique(starts[doc_idx[:-1]])
    return tokens, doc_starts[doc_starts < len(tokens)]


def _create(path: Path, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path``, created exclusively and atomically (temporary name, then a hard link)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # FileExistsError: never replaces a file
    finally:
        tmp.unlink(missing_ok=True)


def write_indexed(prefix: str | Path, documents: Iterable[np.ndarray], dtype: np.dtype | str) -> tuple[int, int]:
    """Write ``PREFIX.bin`` / ``PREFIX.idx`` with one sequence per document (``documents``: 1-D integer arrays of
    token ids, each cast to ``dtype``, a Megatron token dtype). Returns ``(documents, tokens)``. FileExistsError
    when either file exists (checked before anything is written)."""
    dtype = np.dtype(dtype)
    codes = {DTYPE_CODES[c]: c for c in TOKEN_CODES}
    if dtype not in codes:
        raise ValueError(f"dtype = {dtype}: expected one of " + ", ".join(str(d) for d in codes))
    bin_path, idx_path = paths(prefix)
    for p in (bin_path, idx_path):
        if os.path.lexists(p):
            raise FileExistsError(f"{str(p)!r} exists: not overwritten")
    lengths: list[int] = []
    info = np.iinfo(dtype)

    def body() -> Iterable[bytes]:
        for doc in documents:
            doc = np.asarray(doc)
            if len(doc) and (int(doc.min()) < 0 or int(doc.max()) > info.max):
                raise ValueError(f"token id out of {dtype}'s range [0, {info.max}]")
            lengths.append(len(doc))
            yield doc.astype(dtype.newbyteorder("<")).tobytes()

    _create(bin_path, body())
    try:
        n = len(lengths)
        ptrs = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * dtype.itemsize if n else []
        index = [HEADER, struct.pack("<QBQQ", VERSION, codes[dtype], n, n + 1),
                 np.asarray(lengths, dtype="<i4").tobytes(), np.asarray(ptrs, dtype="<i8").tobytes(),
                 np.arange(n + 1, dtype="<i8").tobytes()]
        _create(idx_path, index)
    except BaseException:
        bin_path.unlink(missing_ok=True)  # our own .bin, never another's (its creation was exclusive)
        raise
    return len(lengths), int(sum(lengths))
