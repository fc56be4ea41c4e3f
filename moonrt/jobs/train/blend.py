"""A job's training data: one corpus, or several blended by weight (``data.blend``), each read as
:func:`moonrt.jobs.train.data.load_corpus` reads one, text tokenized by ``data.tokenizer`` first
(:mod:`moonrt.jobs.train.tokenized`).

Blending (Megatron's ``--data-path w1 p1 w2 p2``, torchtitan's weighted datasets) keeps :mod:`~moonrt.jobs.train.data`'s
contract: the global batch of step ``s`` is a pure function of ``(seed, s)``. ``numpy.random.default_rng([seed, s])``
first draws each of the ``B`` rows' corpus (``p = weights / sum(weights)``), then each row's window start uniformly
in that corpus's training split. So a row comes from corpus ``k`` with probability ``p_k``, independently across
rows and steps: over ``N`` rows the count from ``k`` is Binomial(``N``, ``p_k``) (tested within 4 standard
deviations). Resume and every parallel layout see the same windows (they depend on nothing else).

Held-out eval: ``eval_windows`` split over the corpora by weight (largest remainder), each corpus's share evenly
spaced in its held-out split as for one corpus; the unigram baseline is the entropy of the weight-mixed unigram
distributions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from moonrt.jobs.train import data

if TYPE_CHECKING:
    from moonrt.jobs.train.config import DataConfig, JobConfig
    from moonrt.jobs.train.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Blend:
    """Corpora and their sampling probabilities ``p [K]`` (float64, sum 1)."""

    corpora: tuple[data.Corpus, ...]
    p: np.ndarray

    @property
    def description(self) -> str:
        return "blend of " + ", ".join(f"{c.description} (p={w:.3g})" for c, w in zip(self.corpora, self.p))


def rows(blend: Blend, seed: int, step: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(corpus index [B], window start [B])`` of step ``step``'s rows (see the module docstring)."""
    for c in blend.corpora:
        data._check_length(c.train, seq_len, f"training split of {c.description}")
    rng = np.random.default_rng([seed, step])
    which = rng.choice(len(blend.corpora), size=batch_size, p=blend.p)
    highs = np.array([len(c.train) - seq_len - 1 for c in blend.corpora], dtype=np.int64)[which]
    return which, rng.integers(0, highs)


def batch(blend: Blend, seed: int, step: int, batch_size: int, seq_len: int,
          packed: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """The global batch ``[B, seq_len + 1]`` int64 of step ``step`` and, when ``packed``, each token's document
    index within its row's corpus ``[B, seq_len + 1]`` (else None)."""
    which, starts = rows(blend, seed, step, batch_size, seq_len)
    out = np.stack([np.asarray(blend.corpora[k].train[s:s + seq_len + 1], dtype=np.int64)
                    for k, s in zip(which, starts)])
    if not packed:
        return out, None
    docs = np.stack([data.document_ids(blend.corpora[k].train_docs, np.array([s]), seq_len)[0]
                     for k, s in zip(which, starts)])
    return out, docs


def eval_counts(p: np.ndarray, num: int) -> np.ndarray:
    """``num`` held-out windows split by ``p`` (largest remainder; int64 ``[K]`` summing to ``num``)."""
    exact = p * num
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:num - int(counts.sum())]] += 1
    return counts


def eval_windows(blend: Blend, num: int, seq_len: int, packed: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """``num`` held-out windows ``[num, seq_len + 1]`` (and their document indices when ``packed``)."""
    wins, docs = [], []
    for c, n in zip(blend.corpora, eval_counts(blend.p, num)):
        if n == 0:
            continue
        if packed:
            w, d = data.packed_eval_windows(c.heldout, c.heldout_docs, int(n), seq_len)
            docs.append(d)
        else:
            w = data.eval_windows(c.heldout, int(n), seq_len)
        wins.append(w)
    return np.concatenate(wins), (np.concatenate(docs) if packed else None)


def unigram_entropy(blend: Blend, vocab_size: int) -> float:
    """Entropy (nats/token) of the ``p``-weighted mixture of the corpora's held-out unigram distributions."""
    mix = np.zeros(vocab_size, dtype=np.float64)
    for c, w in zip(blend.corpora, blend.p):
        counts = np.zeros(vocab_size, dtype=np.float64)
        for lo in range(0, len(c.heldout), data.CHUNK_TOKENS):
            counts += np.bincount(np.asarray(c.heldout[lo:lo + data.CHUNK_TOKENS], dtype=np.int64),
                                  minlength=vocab_size)[:vocab_size]
        mix += w * counts / max(counts.sum(), 1.0)
    q = mix[mix > 0]
    return float(-(q * np.log(q)).sum()) if len(q) else math.nan


def job_tokenizer(job: JobConfig) -> Tokenizer | None:
    """``data.tokenizer`` loaded and its vocabulary checked against the model's (``--init-from``'s config.json
    when the job starts from one, so call it after :func:`moonrt.jobs.checkpoint.hf.job_init`); None without one.
    TokenizerError (a ValueError, one line) otherwise."""
    if job.data.tokenizer is None:
        return None
    from moonrt.jobs.train.tokenizer import check_vocab, load_tokenizer

    tok = load_tokenizer(job.data.tokenizer)
    source = (f"--init-from {job.init_from!r} config.json vocab_size" if job.init_from is not None
              else f"model {job.model!r} vocab_size" if job.model_config is None else "model_config.vocab_size")
    check_vocab(tok, job.model_cfg().vocab_size, source)
    return tok


def open_corpus(path: str | None, cfg: DataConfig, vocab_size: int, tok: Tokenizer | None, cache_dir: str,
                is_main: bool, agree: Callable[[bool], bool]) -> data.Corpus:
    """One corpus of a job (``cfg``: its :class:`~moonrt.jobs.train.config.DataConfig`): a text file with a
    tokenizer is tokenized into the cache first (:func:`moonrt.jobs.train.tokenized.cached`), then read as the
    indexed dataset; anything else as :func:`moonrt.jobs.train.data.load_corpus` reads it."""
    if tok is not None and path is not None and data.indexed_prefix(path) is None and cfg.token_dtype is None:
        from moonrt.jobs.train import tokenized

        if (what := data._not_a_corpus_file(path)) is not None:
            raise ValueError(f"corpus (--corpus) = {path!r}: {what}; expected an existing text file")
        prefix, _ = tokenized.cached(tok, path, cache_dir, is_main, agree)
        corpus = data.load_corpus(str(prefix), None, vocab_size, cfg.heldout_fraction, cfg.eos_id)
        return dataclasses.replace(corpus, description=f"{path} (tokenized by {tok.path} into {prefix})")
    return data.load_corpus(path, cfg.token_dtype, vocab_size, cfg.heldout_fraction, cfg.eos_id)


def open_blend(cfg: DataConfig, vocab_size: int, tok: Tokenizer | None, cache_dir: str, is_main: bool,
               agree: Callable[[bool], bool]) -> Blend:
    """The corpora of ``cfg.blend`` (each :func:`open_corpus`) and their normalized weights."""
    corpora = tuple(open_corpus(e.path, cfg, vocab_size, tok, cache_dir, is_main, agree) for e in cfg.blend)
    w = np.array([e.weight for e in cfg.blend], dtype=np.float64)
    return Blend(corpora=corpora, p=w / w.sum())
