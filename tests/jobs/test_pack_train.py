"""``moonrt train`` with ``data.pack_documents`` (``--pack-documents``): document ids from the corpus, masked
cross-document targets, the step's loss equal to the documents' losses computed alone, the CLI run, and the
combinations refused (``--cp``, ``--pp``, a user corpus without ``--eos-id``) with one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from numerics import assert_same_function, growth

from moonrt.cli import main
from moonrt.config import ConfigError, from_dict
from moonrt.jobs.train import data
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import train

EOS = 12  # form feed: the byte that ends each document of the test corpora


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.txt"
    docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3) for i in range(300)]
    path.write_text("".join(d + chr(EOS) for d in docs))
    return path


def test_document_starts_ids_and_masked_targets() -> None:
    tokens = np.array([5, 6, EOS, 7, EOS, 8, 9, 9, EOS, 1, 2, 3], dtype=np.uint8)
    starts = data.eos_document_starts(tokens, EOS)
    assert starts.tolist() == [0, 3, 5, 9]  # the EOS token ends (belongs to) its document
    ids = data.document_ids(starts, np.array([1, 4]), 5)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 2], [1, 2, 2, 2, 2, 3]]
    batch = np.stack([tokens[1:7], tokens[4:10]]).astype(np.int64)
    x, y, d = data.shard_packed(batch, ids, 1, 2)  # data rank 1 of 2: the second row
    assert x.tolist() == [[EOS, 8, 9, 9, EOS]] and d.tolist() == [[1, 2, 2, 2, 2]]
    assert y.tolist() == [[data.IGNORE_INDEX, 9, 9, EOS, data.IGNORE_INDEX]]  # 8 and 1 start documents
    assert data.packed_targets(ids) == 10 - 2 - 2


def test_stdlib_documents_are_its_files_and_windows_unchanged() -> None:
    corpus = data.stdlib_corpus()
    sizes = [len(f.read_bytes()) for i, f in enumerate(data.stdlib_files()) if i % 16 != 15]
    assert corpus.train_docs.tolist() == sorted(set(np.cumsum([0, *sizes[:-1]]).tolist()))
    batch, docs = data.packed_batch(corpus.train, corpus.train_docs, 0, 3, 8, 64)
    assert np.array_equal(batch, data.global_batch(corpus.train, 0, 3, 8, 64))  # same windows as unpacked
    assert docs.shape == (8, 65) and (np.diff(docs, axis=1) >= 0).all()


def _job(tmp_path: Path, out: str, pack: bool = True) -> JobConfig:
    opt = {"steps": 2, "batch_size": 2, "seq_len": 64, "warmup_steps": 1, "eval_every": 2, "eval_windows": 2}
    dat = {"corpus": str(_corpus(tmp_path)), "pack_documents": pack, "eos_id": EOS if pack else None}
    return from_dict(JobConfig, {"data": dat, "optim": opt, "out_dir": str(tmp_path / out)})


def test_first_step_loss_is_the_documents_alone(tmp_path: Path) -> None:
    """The step-1 loss of a packed run equals the mean over the batch's documents run one by one through the
    same initial model (each document's tokens alone; targets inside the document only)."""
    job = _job(tmp_path, "a")
    metrics = tmp_path / "m.jsonl"
    train(job, metrics_path=str(metrics), progress=False)
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    corpus = data.load_corpus(job.data.corpus, None, 256, job.data.heldout_fraction, EOS)
    batch, docs = data.packed_batch(corpus.train, corpus.train_docs, job.optim.seed, 0, 2, 64)
    x, y, d = data.shard_packed(batch, docs)
    assert len(np.unique(d[0])) >= 2  # the rows really hold several documents
    model = build_model(job)
    total = 0.0
    with torch.no_grad():
        for b in range(2):
            for doc in np.unique(d[b]):
                cols = np.flatnonzero(d[b] == doc)
                xs, ys = torch.from_numpy(x[b:b + 1, cols]), torch.from_numpy(y[b:b + 1, cols])
                total += float(model.loss_sum(xs, ys))
    alone = total / data.packed_targets(docs)
    cfg = model.config
    la = cfg.linear_attn_config  # the forward's chain, as tests/model/test_packing.py, plus the 128-term loss sum
    c = growth([cfg.hidden_size, cfg.hidden_size, la.head_dim, 64, la.num_heads * la.head_dim, cfg.hidden_size,
                cfg.intermediate_size] * cfg.num_hidden_layers + [cfg.hidden_size] * 2 + [128])
    assert_same_function(torch.tensor(loss), torch.tensor(alone), c, "step-1 loss vs documents alone")
    unpacked = _job(tmp_path, "b", pack=False)
    train(unpacked, metrics_path=str(tmp_path / "u.jsonl"), progress=False)
    assert abs(json.loads((tmp_path / "u.jsonl").read_text().splitlines()[0])["loss"] - loss) > 1e-4


def test_cli_packed_run_and_refusals(tmp_path: Path, capsys) -> None:
    corpus = str(_corpus(tmp_path))
    common = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--no-progress"]
    rc = main([*common, "--corpus", corpus, "--pack-documents", "--eos-id", str(EOS), "--out", str(tmp_path / "o"),
               "--metrics", str(tmp_path / "m.jsonl")])
    assert rc == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    assert np.isfinite(records[-1]["eval_loss"])
    for flags, message in [
        (["--pack-documents", "--cp", "2"],
         "data.pack_documents (--pack-documents) = True: expected false with parallel.cp = 2 (--cp)"),
        (["--pack-documents", "--pp", "2"],
         "data.pack_documents (--pack-documents) = True: expected false with parallel.pp = 2 (--pp)"),
        (["--pack-documents", "--corpus", corpus], "data.eos_id = None: expected the token id that ends each"),
        (["--corpus", corpus, "--eos-id", "12"],
         "data.eos_id (--eos-id) = 12: expected null unless pack_documents is true"),
    ]:
        assert main([*common, *flags, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    with pytest.raises(ConfigError, match="data.eos_id = -1"):
        from_dict(JobConfig, {"data": {"corpus": corpus, "pack_documents": True, "eos_id": -1}})


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_data_parallel_packed_step_equals_single_process(tmp_path: Path) -> None:
    """dp 2 (2 gloo ranks, a row each) and ep 2 (MoonEP: the packed rows' tokens dispatched to other ranks' experts)
    take the same first step as one process: the loss is divided by the global count of unmasked targets on every
    rank. Tolerance as tests/jobs/test_zero_train.py (two half-batch
    backwards summed vs one, fp64 vs fp32 clip norm: ~1e-6 relative)."""
    from jobs.helpers import RTOL, _here, _metrics, _ranks, _run

    corpus = str(_corpus(tmp_path))
    flags = ("train", "--steps", "2", "--until", "1", "--batch-size", "2", "--seq-len", "64", "--threads", "1",
             "--no-progress", "--corpus", corpus, "--pack-documents", "--eos-id", str(EOS))
    _run(tmp_path, {"single": _here(*flags, "--out", "single", "--metrics", "single.jsonl"),  # the reference
                    "dp2": _ranks(2, *flags, "--out", "dp2", "--metrics", "dp2.jsonl"),
                    "ep2": _ranks(2, *flags, "--out", "ep2", "--metrics", "ep2.jsonl", "--ep", "2")}, timeout=1700)
    ref = _metrics(tmp_path / "single.jsonl")[1]
    for name in ("dp2", "ep2"):
        got = _metrics(tmp_path / f"{name}.jsonl")[1]
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= RTOL * abs(ref[key]), (name, key, got[key], ref[key])
