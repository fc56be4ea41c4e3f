"""What ``moonrt train`` reports (issue 36 item 11) and ``--grad-accum``.

- Model FLOPs per token (``ModelSpec.flops_per_token``) equal a hand computation (dense_tiny: PaLM's
  ``6 N + 12 L H Q T``; k3_tiny: ``6 x active`` + its MLA and KDA terms), and the metrics records carry ``time``,
  ``elapsed_s``, ``peak_mem_bytes``, ``tokens_per_s``, ``model_tflops_per_s`` and, with ``--peak-tflops``, ``mfu``,
  consistent with each other and with the clock and this process's peak RSS.
- ``--tensorboard DIR``: the scalars read back with TensorBoard's own ``EventAccumulator`` equal the metrics file's
  (float32 events: 1e-6 relative); a fresh run refuses a non-empty DIR; a missing package is a one-line error.
- Output that is not a terminal (a pipe): no ``\\r`` anywhere, a plain line every ``--log-every`` steps, the eval
  lines and the summary; ``--no-progress`` drops the periodic lines only.
- ``--grad-accum``: one step resumed from the shared single-process checkpoint (``tests/jobs/conftest.py``) with 2
  and 4 micro-steps, and with ``--zero 1 --grad-accum 2`` on 2 gloo ranks, equals the plain step within
  ``helpers.RTOL`` (1e-5; the micro-steps only change the fp32 summation order of the gradients, ~1e-7, as
  ``test_zero_train``'s dp 2 does); a divisor that does not divide the per-rank batch, and ``--pp``, are refused.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from jobs.helpers import FLAGS, _assert_same_step, _ckpt, _cli, _here, _metrics, _moonrt, _ranks, _run

from moonrt.cli import main
from moonrt.comm.parallelism import Parallelism
from moonrt.config import ConfigError, from_dict
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import train
from moonrt.jobs.train.report import peak_memory_bytes
from moonrt.models import presets

ROOT = Path(__file__).resolve().parents[2]


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return corpus


def _tiny(tmp_path: Path, out: str, *extra: str) -> list[str]:
    """A few-second dense_tiny run on a small text corpus."""
    return ["train", "--model", "dense_tiny", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len",
            "16", "--steps", "4", "--eval-every", "2", "--threads", "1", "--out", str(tmp_path / out), *extra]


def test_flops_per_token_equals_a_hand_count() -> None:
    dense = presets()["dense_tiny"]
    # dense_tiny: V 256, D 128, F 384, L 4, H 4 x 32, untied head. Active = all but the input embedding:
    # per layer attention 4*4*32*128 = 65,536 + SwiGLU 3*128*384 = 147,456 + 2 norms 256 = 213,248; x 4 = 852,992;
    # final norm 128, LM head 256*128 = 32,768 -> 885,888. 6 N = 5,315,328; 12 L H Q T at T = 128: 786,432.
    assert dense.flops_per_token(dense.presets["dense_tiny"](), 128) == 5_315_328 + 786_432
    assert dense.flops_per_token(dense.presets["dense_tiny"](), 16) == 5_315_328 + 12 * 4 * 4 * 32 * 16
    k3 = presets()["k3_tiny"]
    cfg = k3.presets["k3_tiny"]()
    from moonrt.models.k3.model.params import count_params

    # k3_tiny: KKKM KKKM M -> 6 KDA layers (4 heads, K = V = 48), 3 MLA layers (4 heads, dk 32 + 16, dv 32)
    mla, kda = 3 * 2 * 128 * 4 * (48 + 32), 6 * 6 * 4 * 48 * 48
    assert k3.flops_per_token(cfg, 128) == 6 * count_params(cfg).active + 3 * (mla + kda)
    assert count_params(cfg).active < count_params(cfg).total  # MoE: only the top-2 of 16 experts are active


def test_records_carry_time_memory_and_model_flops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = time.time()
    assert main(_tiny(tmp_path, "a", "--metrics", str(tmp_path / "a.jsonl"), "--peak-tflops", "0.5")) == 0
    after = time.time()
    assert main(_tiny(tmp_path, "b", "--metrics", str(tmp_path / "b.jsonl"))) == 0
    capsys.readouterr()
    rss = peak_memory_bytes("cpu")  # this process's peak so far (what the run's records read, at its end)
    flops = presets()["dense_tiny"].flops_per_token(presets()["dense_tiny"].presets["dense_tiny"](), 16)
    recs = list(_metrics(tmp_path / "a.jsonl").values())
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for prev, r in zip([None, *recs], recs):
        assert before <= r["time"] <= after, r
        assert 0 < r["elapsed_s"] <= after - before, r
        assert 32 / r["tokens_per_s"] <= r["elapsed_s"] * (1 + 1e-9), r  # the step's time is within the elapsed
        assert r["model_tflops_per_s"] == pytest.approx(flops * r["tokens_per_s"] / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / 0.5, rel=1e-12)
        assert 50 << 20 < r["peak_mem_bytes"] <= rss, (r, rss)  # torch alone is > 50 MiB; this process's peak
        if prev is not None:
            assert r["time"] >= prev["time"] and r["elapsed_s"] > prev["elapsed_s"]
            assert r["peak_mem_bytes"] >= prev["peak_mem_bytes"]
    no_peak = list(_metrics(tmp_path / "b.jsonl").values())
    assert all("mfu" not in r and r["model_tflops_per_s"] > 0 for r in no_peak)


def test_peak_tflops_must_be_positive(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["train", "--peak-tflops", "0", "--out", str(tmp_path / "o")], capfd)
    assert code == 2 and "log.peak_tflops (--peak-tflops) = 0.0: expected a finite number > 0" in err, err


def test_tensorboard_scalars_equal_the_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard", reason="the optional tensorboard package (moonrt[tensorboard]) is missing")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    assert main(_tiny(tmp_path, "a", "--metrics", str(tmp_path / "a.jsonl"), "--tensorboard", str(tb),
                      "--peak-tflops", "1", "--until", "3")) == 0
    assert main(_tiny(tmp_path, "a", "--metrics", str(tmp_path / "a.jsonl"), "--tensorboard", str(tb),
                      "--peak-tflops", "1", "--resume")) == 0  # appends a second event file
    capsys.readouterr()
    recs = _metrics(tmp_path / "a.jsonl")
    acc = EventAccumulator(str(tb))
    acc.Reload()
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "train/tokens_per_s"), ("mfu", "train/mfu"), ("eval_loss", "eval/loss")):
        got = {e.step: e.value for e in acc.Scalars(tag)}
        want = {s: r[key] for s, r in recs.items() if key in r}
        assert sorted(got) == sorted(want) and want, (tag, got, want)
        for s in want:  # events hold float32
            assert got[s] == pytest.approx(want[s], rel=1e-6), (tag, s)
    assert sorted(recs) == [1, 2, 3, 4] and sorted(e.step for e in acc.Scalars("eval/loss")) == [2, 4]
    # a fresh run never writes beside another run's events
    code = main(_tiny(tmp_path, "b", "--tensorboard", str(tb)))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"moonrt train: error: log.tensorboard (--tensorboard) = {str(tb)!r}: not empty "), err


def test_tensorboard_without_the_package_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    code, out, err = _cli(_tiny(tmp_path, "o", "--tensorboard", str(tmp_path / "tb")), capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "log.tensorboard (--tensorboard) = " in lines[0] and "needs the tensorboard package" in lines[0], err
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_output_to_a_pipe_has_plain_lines_and_no_carriage_return(tmp_path: Path) -> None:
    res = subprocess.run(_moonrt(*_tiny(tmp_path, "o", "--log-every", "3", "--peak-tflops", "1")), cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "\r" not in res.stdout + res.stderr, (res.stdout + res.stderr)[-4000:]
    lines = res.stdout.splitlines()
    periodic = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d train: step ", line)]
    assert [line[20:].split(",")[0] for line in periodic] == ["train: step 3/4", "train: step 4/4"], res.stdout
    assert all(" tok/s, " in line and "mfu " in line and "peak mem " in line for line in periodic), periodic
    assert re.search(r", eta \d+s$", periodic[0]) and periodic[1].endswith(", eta 0s"), periodic
    assert sum(line.startswith(("step 2: train loss", "step 4: train loss")) for line in lines) == 2, res.stdout
    assert sum(line.startswith("summary: 4 steps in ") for line in lines) == 1, res.stdout


def test_no_progress_keeps_the_eval_lines_and_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tiny(tmp_path, "o", "--log-every", "1", "--no-progress")) == 0
    out, err = capsys.readouterr()
    assert "train: step" not in out and "\r" not in out + err, out
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 2", "step 4"], out
    assert sum(line.startswith("summary: ") for line in lines) == 1, out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_grad_accum_step_equals_the_plain_step(tmp_path: Path, single_process_steps: Path) -> None:
    shared = single_process_steps  # base (k3_tiny, step 1) and the single process's step 2
    common = ("train", *FLAGS, "--resume", "--until", "2")
    runs = {"accum2": _here(*common, "--out", "accum2", "--metrics", "accum2.jsonl", "--grad-accum", "2"),
            "accum4": _here(*common, "--out", "accum4", "--metrics", "accum4.jsonl", "--grad-accum", "4"),
            "zero_dp2_accum2": _ranks(2, *common, "--out", "zero_dp2_accum2", "--metrics", "zero_dp2_accum2.jsonl",
                                      "--zero", "1", "--grad-accum", "2")}
    for name in runs:
        shutil.copytree(shared / "base", tmp_path / name)
    _run(tmp_path, runs, timeout=1100)
    ref, ref_ckpt = _metrics(shared / "single.jsonl")[2], _ckpt(shared / "single")
    for name in runs:
        _assert_same_step(tmp_path, name, ref, ref_ckpt)


def test_accumulate_runs_n_micro_steps_whose_gradients_sum_to_the_whole_batchs() -> None:
    """The loop's micro-steps (``loop._accumulate``) on dense_tiny: ``n`` forwards of ``B / n`` consecutive rows
    each, and the accumulated gradient and loss equal one backward of the whole batch (fp32 order: 1e-5)."""
    import numpy as np
    import torch

    from moonrt.comm.parallelism import Part
    from moonrt.jobs.train.assemble import build_model
    from moonrt.jobs.train.loop import _accumulate

    class Rows(Part):
        def __init__(self) -> None:
            self.seen: list[list[int]] = []

        def forward_backward(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float,
                             ctx: object = None, saved: object = None) -> None:
            self.seen.append(x[:, 0].tolist())
            return None  # the default path runs the forward and backward

    torch.manual_seed(0)
    model = build_model(from_dict(JobConfig, {"model": "dense_tiny"}))
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    grads, losses = {}, {}
    for n in (1, 2, 4):
        part = Rows()
        model.zero_grad(set_to_none=True)
        losses[n] = float(_accumulate(model, Parallelism(parts=[part]), x, y, None, n, 1.0 / y.size, None))
        grads[n] = [p.grad.clone() for p in model.parameters()]
        assert part.seen == [x[i * 4 // n:(i + 1) * 4 // n, 0].tolist() for i in range(n)], (n, part.seen)
    for n in (2, 4):
        assert losses[n] == pytest.approx(losses[1], rel=1e-6)
        for a, b in zip(grads[n], grads[1]):
            assert float((a - b).norm()) <= 1e-5 * max(float(b.norm()), 1e-12)


def test_grad_accum_must_divide_the_per_rank_batch(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(_tiny(tmp_path, "o", "--grad-accum", "3"), capfd)
    assert code == 2 and "optim.grad_accum (--grad-accum) = 3: expected a divisor of batch_size 2" in err, err
    code, out, err = _cli(["train", "--pp", "2", "--grad-accum", "2", "--out", str(tmp_path / "p")], capfd)
    assert code == 2 and "optim.grad_accum (--grad-accum) = 2: expected 1 with parallel.pp = 2 (--pp): the " \
        "pipeline splits each step into its own micro-batches" in err, err
    job = from_dict(JobConfig, {"model": "dense_tiny", "data": {"corpus": str(_corpus(tmp_path))},
                                "optim": {"steps": 1, "batch_size": 4, "seq_len": 16, "grad_accum": 4},
                                "out_dir": str(tmp_path / "dp")})
    with pytest.raises(ConfigError, match=r"optim.grad_accum \(--grad-accum\) = 4: expected a divisor of the "
                                          r"per-rank batch 2 \(optim.batch_size 4 / data-parallel size 2\)"):
        train(job, rt=Parallelism(dp_size=2), progress=False)


def test_readme_documents_the_new_fields_and_flags() -> None:
    text = (ROOT / "README.md").read_text()
    for word in ("peak_mem_bytes", "model_tflops_per_s", "mfu", "--peak-tflops", "--tensorboard", "--log-every",
                 "--grad-accum", "elapsed_s"):
        assert word in text, word
