"""A model's own tokenizer, read from disk (``data.tokenizer``, ``--tokenizer PATH``; never downloaded).

Two formats, told apart by their content:

- a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``; the ``tokenizers`` library): its vocabulary size
  counts the added (special) tokens;
- a tiktoken BPE file (``tiktoken.model``, Kimi's form; the ``tiktoken`` library): one ``base64(token) rank``
  line per token. Its special tokens come from a ``tokenizer_config.json`` beside it (the Hugging Face
  ``added_tokens_decoder`` mapping ``"id": {"content": ...}``, as Kimi's releases ship it), when present. The
  pre-tokenizer regex is :data:`TIKTOKEN_PATTERN` (cl100k_base's).

Both libraries are optional (``pip install moonrt[data]``), imported when a tokenizer is loaded, with one line
naming the package when missing. Special-token text in a corpus is encoded as plain text, never as the special
token (a corpus cannot inject control tokens).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_TOKENIZER_BYTES = 256 * 2**20
"""Largest tokenizer file read (Kimi's tiktoken.model is ~2.8 MB, large HF tokenizer.json files ~20 MB)."""
MAX_CONFIG_BYTES = 16 * 2**20
"""Largest ``tokenizer_config.json`` read beside a tiktoken file."""

TIKTOKEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""The pre-tokenizer regex of a tiktoken file: cl100k_base's (a file carries no regex of its own)."""

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: one line naming ``data.tokenizer`` and what was expected."""


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: ``encode(text) -> list[int]``, its vocabulary size, its kind and file digest."""

    path: str
    kind: str
    """``hf`` or ``tiktoken``."""
    vocab_size: int
    sha256: str
    """SHA-256 of the tokenizer file (and of a tiktoken file's ``tokenizer_config.json``): the cache key's part."""
    encode: Callable[[str], list[int]]


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise TokenizerError(f"data.tokenizer (--tokenizer): needs the {name!r} package, which is not installed "
                             f"(pip install {name}, or moonrt[data])") from None


def _read(path: Path, limit: int, what: str) -> bytes:
    size = path.stat().st_size
    if size > limit:
        raise TokenizerError(f"data.tokenizer (--tokenizer) = {what!r}: {size} bytes, expected at most {limit} "
                             "(MAX_TOKENIZER_BYTES)")
    with open(path, "rb") as f:
        return f.read(limit + 1)[:limit]


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in file ``path`` (HF JSON or tiktoken BPE, by content). TokenizerError, one line, when the
    path is missing (naming a hub id as such: nothing is downloaded), not a regular file, too large, or neither
    format."""
    p = Path(path)
    flag = f"data.tokenizer (--tokenizer) = {path!r}"
    if not p.exists():
        if _HUB_NAME.match(path):
            raise TokenizerError(f"{flag}: no such file; it looks like a Hugging Face hub name, and moonrt reads "
                                 "tokenizers from disk only (download it, e.g. huggingface-cli download, and pass the "
                                 "tokenizer.json or tiktoken.model path)")
        raise TokenizerError(f"{flag}: no such file; expected a tokenizer.json or tiktoken BPE file")
    if not p.is_file():
        raise TokenizerError(f"{flag}: not a regular file; expected a tokenizer.json or tiktoken BPE file")
    raw = _read(p, MAX_TOKENIZER_BYTES, path)
    digest = hashlib.sha256(raw)
    if raw.lstrip()[:1] == b"{":
        return _hf(path, raw, digest.hexdigest())
    return _tiktoken(path, raw, digest)


def _hf(path: str, raw: bytes, sha: str) -> Tokenizer:
    tokenizers = _import("tokenizers")
    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the library's parse errors (a Rust exception type)
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(f"data.tokenizer (--tokenizer) = {path!r}: not a Hugging Face tokenizers JSON file "
                             f"({msg})") from None

    tok.encode_special_tokens = True  # special-token text in a corpus is plain text

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return Tokenizer(path=path, kind="hf", vocab_size=tok.get_vocab_size(with_added_tokens=True), sha256=sha,
                     encode=encode)


def _tiktoken(path: str, raw: bytes, digest: Any) -> Tokenizer:
    flag = f"data.tokenizer (--tokenizer) = {path!r}"
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except ValueError:
            raise TokenizerError(f"{flag}: line {n} is not 'base64-token rank'; expected a tokenizer.json (JSON) or a "
                                 "tiktoken BPE file") from None
    if not ranks:
        raise TokenizerError(f"{flag}: no tokens; expected a tokenizer.json or tiktoken BPE file")
    if len(set(ranks.values())) != len(ranks) or min(ranks.values()) < 0:
        raise TokenizerError(f"{flag}: ranks must be distinct integers >= 0")
    specials: dict[str, int] = {}
    config = Path(path).with_name("tokenizer_config.json")
    if config.is_file():
        text = _read(config, MAX_CONFIG_BYTES, str(config))
        digest.update(text)
        try:
            added = json.loads(text).get("added_tokens_decoder", {})
            specials = {v["content"]: int(k) for k, v in added.items()}
        except (ValueError, AttributeError, KeyError, TypeError):
            raise TokenizerError(f"{flag}: {str(config)!r} beside it is not a tokenizer_config.json with an "
                                 "added_tokens_decoder mapping of 'id': {'content': ...}") from None
        specials = {k: v for k, v in specials.items() if v not in ranks.values()}
    tiktoken = _import("tiktoken")
    try:
        enc = tiktoken.Encoding(name=Path(path).name, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                                special_tokens=specials)
    except Exception as exc:  # tiktoken's ValueError / Rust panics on inconsistent ranks
        raise TokenizerError(f"{flag}: tiktoken refused it ({str(exc).splitlines()[0] if str(exc) else exc!r})") \
            from None

    def encode(text: str) -> list[int]:
        return enc.encode(text, disallowed_special=())

    vocab = max([*ranks.values(), *specials.values()]) + 1
    return Tokenizer(path=path, kind="tiktoken", vocab_size=vocab, sha256=digest.hexdigest(), encode=encode)


def check_vocab(tok: Tokenizer, model_vocab: int, source: str) -> None:
    """TokenizerError unless the tokenizer's vocabulary is the model's: equal, or the model's is the tokenizer's
    padded to a multiple of 128 (Megatron's ``make_vocab_size_divisible_by``). ``source``: where the model's
    vocabulary comes from (``--init-from``'s config.json, the model preset)."""
    padded = -(-tok.vocab_size // 128) * 128
    if model_vocab not in (tok.vocab_size, padded):
        raise TokenizerError(f"data.tokenizer (--tokenizer) = {tok.path!r}: vocabulary of {tok.vocab_size} tokens, "
                             f"the model's ({source}) is {model_vocab}; expected a tokenizer of the model's vocabulary")
