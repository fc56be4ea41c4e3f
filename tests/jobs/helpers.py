"""Shared helpers of the ``moonrt train`` job tests: run the CLI in this process (:func:`_here`) or as real ranks
(:func:`_launch`), several runs at once (:func:`_run`), read metrics and checkpoints, and compare one resumed step
of a layout with the single-process step (:func:`_assert_same_step`, relative ``RTOL`` normwise per tensor).

``FLAGS`` is the small job every layout test resumes (``single_process_steps`` in ``tests/jobs/conftest.py`` runs
it once per session).

Also what several job tests share beyond that: the hardening tests' small ``moonrt train`` argv
(:func:`_train_argv` on :func:`_corpus`, :func:`_records`, :func:`_one_error_line`), ZeRO-1's AdamW bytes per rank
(:func:`_adamw_bytes_per_rank`), bitwise equality of checkpoint trees (:func:`_equal`) and the documented
collectives table (:func:`missing_doc_rows`). Import as ``from jobs.helpers import ...`` (tests/ is on ``sys.path``;
a bare ``helpers`` would be a second module object, or another directory's helpers).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

FLAGS = ["--steps", "4", "--seed", "0", "--batch-size", "4", "--seq-len", "32", "--eval-every", "100", "--lr", "1e-3",
         "--threads", "1", "--no-progress"]
RTOL = 1e-5
EVAL_SMALL = ["--set", "optim.eval_windows=4"]
"""For runs whose eval (each run's last step) no assertion reads: one batch of ``FLAGS``' 4 rows instead of the
default 32 windows, which every data-parallel replica evaluates whole (~40% of a two-step run). Layouts' evals are
compared in ``test_pp_train.py``, ``test_ep_train.py`` and ``test_cp_train.py``."""


def _moonrt(*args: str) -> list[str]:
    return [sys.executable, "-m", "moonrt.cli", *args]


def _cli(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``moonrt ARGS`` in this process: the exit code ``python -m moonrt.cli`` exits with, and the stdout and stderr
    it wrote (file-descriptor level). For bad input that ``moonrt train`` refuses before it starts a job (no
    process group, no threads set: asserted), without the ~6 s of imports of a new process."""
    from moonrt.cli import main

    threads = torch.get_num_threads()
    code = main(args)
    out, err = capfd.readouterr()
    assert not torch.distributed.is_initialized() and torch.get_num_threads() == threads, args
    return code, out, err


def _launch(n: int, *args: str) -> list[str]:
    return _moonrt("launch", "-n", str(n), "--", *_moonrt(*args))


_RANK_SERVER: list[Any] = []
"""This process's :class:`forkrun.RankServer`, started by the first :func:`_ranks` (closed at exit)."""


def _ranks(n: int, *args: str) -> list[str]:
    """``moonrt ARGS`` on ``n`` local gloo ranks forked from one process that imported torch once
    (``tests/forkrun.py``), with the environment ``moonrt launch -n N`` gives its ranks: for the tests whose property
    is a layout's result, not the launcher (that :func:`_launch` keeps testing), without ``n - 1`` new interpreters'
    ~3-5 s of imports each on 2 cores. That process is this test process's rank server (one per pytest worker: its
    imports paid once, not once per job); the command is its client (a new interpreter without torch)."""
    if not _RANK_SERVER:
        from forkrun import RankServer

        _RANK_SERVER.append(RankServer(dict(os.environ)))
        atexit.register(_RANK_SERVER[0].close)
    return _RANK_SERVER[0].argv(n, list(args))


def _here(*args: str) -> tuple[str, ...]:
    """A ``moonrt ARGS`` run that :func:`_run` makes in this process (``moonrt.cli.main``) instead of a new one:
    for the single-process runs a test resumes from or compares against (not what it tests), which would
    otherwise each pay a new interpreter's ~6 s of imports (torch, torch._dynamo, numba), alone on one core
    when nothing else runs beside them."""
    return args


def _main_here(cwd: Path, args: tuple[str, ...]) -> None:
    """``moonrt ARGS`` in this process with ``cwd`` as the working directory; the torch thread count and RNG
    state are this process's again afterwards (``moonrt train --threads`` sets the count, the job seeds torch),
    and no process group is left (one process never joins one)."""
    from moonrt.cli import main

    threads, here = torch.get_num_threads(), os.getcwd()
    try:
        os.chdir(cwd)  # contextlib.chdir is Python 3.11+
        with torch.random.fork_rng(devices=[]):
            code = main(list(args))
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
    assert code == 0 and not torch.distributed.is_initialized(), (args, code)


def _run(cwd: Path, cmds: dict[str, list[str] | tuple[str, ...]], timeout: float = 840) -> None:
    """Every command of ``cmds`` at once in ``cwd``; each must exit 0. Lists are new processes; tuples
    (:func:`_here`) run in this process, one after another, while the new processes run (their output goes to
    files, so none blocks on a full pipe meanwhile)."""
    with contextlib.ExitStack() as stack:
        procs = {}
        for k, c in cmds.items():
            if isinstance(c, list):
                out = stack.enter_context(tempfile.TemporaryFile("w+"))
                procs[k] = (subprocess.Popen(c, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True), out)
        try:
            for c in cmds.values():
                if isinstance(c, tuple):
                    _main_here(cwd, c)
            deadline = time.monotonic() + timeout
            for p, _ in procs.values():
                p.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:  # a failure here leaves no job running on (moonrt launch stops its ranks on SIGTERM)
            for p, _ in procs.values():
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
        for k, (p, out) in procs.items():
            out.seek(0)
            assert p.returncode == 0, f"{k}:\n{out.read()[-4000:]}"


def _metrics(path: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _ckpt(path: Path) -> dict[str, Any]:
    """The run's newest checkpoint (multi-rank jobs write the sharded OUT/checkpoint/, one process checkpoint.pt)
    in the single-process ``checkpoint.pt`` format."""
    from moonrt.jobs.checkpoint.store import read_state
    from moonrt.jobs.train.resume import BUILDER

    return read_state(path, BUILDER)


def _close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            err = float((a.double() - b.double()).norm())
            assert err <= RTOL * max(float(b.double().norm()), 1e-12), (where, err, float(b.double().norm()))
        else:
            assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def _assert_same_step(tmp_path: Path, name: str, ref: dict[str, Any], ref_ckpt: dict[str, Any],
                      step: int = 2) -> dict[str, Any]:
    """Run ``name``'s step ``step`` (``<name>.jsonl`` and ``<name>/``'s checkpoint) against the single process's
    metrics ``ref`` and checkpoint ``ref_ckpt``: loss and grad norm, every parameter and optimizer tensor within
    ``RTOL`` relative (normwise per tensor); returns the run's step record."""
    got = _metrics(tmp_path / f"{name}.jsonl")[step]
    assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (name, got["loss"], ref["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], (name, got["grad_norm"],
                                                                                 ref["grad_norm"])
    ck = _ckpt(tmp_path / name)
    assert ck["step"] == step and list(ck["model"]) == list(ref_ckpt["model"]), name
    _close(ck["model"], ref_ckpt["model"], f"{name}.model")
    _close(ck["optimizer"], ref_ckpt["optimizer"], f"{name}.optimizer")
    return got


# ---- shared by the input- and output-hardening tests (test_train_hardening.py and its neighbours) ---------------

def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return corpus


def _train_argv(tmp_path: Path, out: str, *extra: str) -> list[str]:
    """``moonrt train`` argv (for :func:`moonrt.cli.main`): a small job on :func:`_corpus`, writing ``tmp_path / out``
    (``moonrt train`` input-hardening tests)."""
    return ["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
            "--out", str(tmp_path / out), "--no-progress", *extra]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("moonrt train: error: "), err
    return lines[0]


# ---- checkpoints and optimizer state ----------------------------------------------------------------------------

FIXTURE_MODEL = [f"model_config.{k}={v}" for k, v in (
    ("hidden_size", 16), ("intermediate_size", 32), ("moe_intermediate_size", 8), ("routed_expert_hidden_size", 8),
    ("q_lora_rank", 8), ("kv_lora_rank", 8), ("qk_nope_head_dim", 4), ("qk_rope_head_dim", 4), ("v_head_dim", 4),
    ("linear_attn_config.head_dim", 4), ("num_experts", 4), ("num_shared_experts", 1))]
"""k3_tiny's structure (9 layers KKKMKKKMM, MoE, MLA) at ~40k parameters: the model of the committed checkpoint
fixtures (``tests/jobs/fixtures/make_checkpoints.py``, ~0.65 MB a checkpoint)."""
FIXTURE_FLAGS = [*FLAGS, *EVAL_SMALL, *(a for kv in FIXTURE_MODEL for a in ("--set", kv))]
"""The ``moonrt train`` flags the fixtures were written with and every run resumed from them takes."""


def _adamw_bytes_per_rank(dp: int) -> int:
    """AdamW state bytes of one rank under ZeRO-1 over ``dp`` replicas of k3_tiny (one fp32 bucket): two
    ``[ceil(L / dp)]`` fp32 moment shards and the ``[P]`` fp64 step counts."""
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.config import JobConfig

    params = [p for p in build_model(JobConfig(model="k3_tiny")).parameters() if p.requires_grad]
    assert {p.dtype for p in params} == {torch.float32}
    total = sum(p.numel() for p in params)
    return 2 * 4 * -(-total // dp) + 8 * len(params)


def _equal(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested dicts / lists / tensors / numbers."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


# ---- the documented collectives table (test_nccl_ops.py, test_layout_checks.py) --------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def _doc_rows() -> list[tuple[set[str], set[str]]]:
    """``(calls, groups)`` of every row of the collectives table in docs/ARCHITECTURE.md (the backticked names of
    its first two cells)."""
    text = DOC.read_text()
    table = text[text.index("<!-- collectives -->"):text.index("<!-- /collectives -->")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows.append((set(re.findall(r"`([a-z_]+)`", cells[0])), set(re.findall(r"`([a-z_]+)`", cells[1]))))
    return rows


def missing_doc_rows(calls: Any) -> list[str]:
    """The recorded calls (``calls``: lists of every rank's :class:`Call` lists) without a row in the documented
    table: a row names the call and one of the names the group has in the mesh (``world`` for the default group,
    ``cpu`` / ``cpu_pp`` for the CPU groups)."""
    rows = _doc_rows()
    assert rows
    missing = set()
    for every in calls:
        for c in (c for cs in every for c in cs):
            if not any(c.fn in fns and groups & set(c.labels) for fns, groups in rows):
                missing.add(f"{c.fn} on {'/'.join(c.labels) or c.group} ({c.where}"
                            + (f" via {c.via}" if c.via else "") + ")")
    return sorted(missing)


# ---- checkpoint files (test_checkpoint_hardening, test_checkpoint_marker) ----


def _linear(seed: int = 0, n: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Linear layer and its AdamW after one step (every parameter has state)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(n, n)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, n)).sum().backward()
    opt.step()
    return model, opt


def _sharded(root: Path, step: int = 1, seed: int = 0) -> Path:
    model, opt = _linear(seed)
    from moonrt.jobs.checkpoint import sharded
    from moonrt.jobs.train.config import JobConfig

    return sharded.save_sharded(root, model, opt, step, JobConfig())


def _one_line(capsys: Any) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moonrt checkpoint: "), err
    assert "Traceback" not in err, err
    return lines[0]


def _load_linear(step_dir: Path, seed: int = 5) -> torch.nn.Module:
    model, opt = _linear(seed)
    from moonrt.jobs.checkpoint import sharded

    sharded.load_sharded(step_dir, model, opt)
    return model


# ---- output trees (test_train_outputs_hardening*) ----


def _tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under ``path``: file bytes, link targets, directories."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else ("<dir>" if p.is_dir() else p.read_bytes())
    return out


# ---- the model's tokenizer (issue 50: test_indexed_data.py, test_tokenizer_train.py) -------------------------

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # the quick brown fox jumps {i}\n" for i in range(300))


def hf_tokenizer(path: Path, vocab: int = 256) -> Path:
    """A BPE tokenizer of exactly ``vocab`` tokens trained here with ``tokenizers`` on a few KB of text."""
    import tokenizers  # the test extra installs it (pyproject.toml)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator([TEXT], trainer=trainer)
    assert tok.get_vocab_size() == vocab
    tok.save(str(path))
    return path
