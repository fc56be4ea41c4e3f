"""Preemption: a stop signal makes every rank finish its step, agree on it, checkpoint it and exit with 75.

Jobs run as real processes (``moonrt train``, ``moonrt launch -n 2 -- moonrt train``) and are signalled once
their metrics file shows step >= 2. Each interrupted run is compared with an uninterrupted one of the same
layout started at the same time: the checkpoint holds the last step in the metrics (no completed step lost),
the resumed run's losses, gradient norms, parameters and optimizer state equal the uninterrupted run's
exactly (same layout, same arithmetic: bit-identical). The ``moonrt sbatch --requeue`` script's shell logic
is run with stand-ins for ``srun`` / ``scontrol``; under a real SLURM (skip, or fail with
``MOONRT_REQUIRE_CLUSTER=1``) a job is preempted with ``scancel --signal=USR1 --batch``, requeued and finishes
with the uninterrupted run's losses.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cluster.helpers import (
    MOONRT,
    STEPS,
    _assert_same_run,
    _config,
    _finish,
    _records,
    _train,
    _wait_for_step,
    clean_env,
    require_slurm,
)

from moonrt.cluster.launch import launch
from moonrt.cluster.preempt import PREEMPTED_EXIT
from moonrt.cluster.sbatch import SbatchJob, render_sbatch, requeue_command
from moonrt.comm.parallelism import Parallelism, Part
from moonrt.config import from_dict
from moonrt.jobs.checkpoint import store
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import Preempted, train
from moonrt.jobs.train.resume import BUILDER


def _start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _stopped(run: Path, out: str, code: int) -> int:
    """Check a stopped run: exit 75, its checkpoint at the last step of its metrics; returns that step."""
    assert code == PREEMPTED_EXIT, out[-4000:]
    steps = [r["step"] for r in _records(run)]
    state = store.read_state(run / "out", BUILDER)
    assert steps == list(range(1, state["step"] + 1)), (steps, state["step"])
    assert 2 <= state["step"] < STEPS, "the signal came after the run had finished (raise STEPS)"
    assert f"after step {state['step']} of {STEPS}; checkpoint" in out, out[-4000:]
    return state["step"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("preempt")
    _config(d)
    return d


@pytest.fixture(scope="module")
def reference2(workdir: Path) -> Callable[[], Path]:
    """An uninterrupted 2-rank run (started now, in the background); calling the result waits for it."""
    run = workdir / "ref2"
    proc = _start([*MOONRT, "launch", "-n", "2", "--timeout", "120", "--", *MOONRT,
                   *_train(workdir / "job.yaml", run)], workdir)
    done: list[Path] = []

    def result() -> Path:
        if not done:
            code, out = _finish(proc)
            assert code == 0, out[-4000:]
            done.append(run)
        return run

    yield result
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_usr1_single_process_saves_the_last_step_and_resumes_bit_identically(workdir: Path) -> None:
    cfg, run, ref = workdir / "job.yaml", workdir / "usr1", workdir / "ref1"
    reference = _start([*MOONRT, *_train(cfg, ref)], workdir)
    job = _start([*MOONRT, *_train(cfg, run, "--signal", "USR1")], workdir)
    _wait_for_step(run, 2, lambda: job.poll() is None)
    job.send_signal(signal.SIGUSR1)
    code, out = _finish(job)
    _stopped(run, out, code)
    assert "stopped by SIGUSR1" in out
    code, out = _finish(_start([*MOONRT, *_train(cfg, run, "--resume-if-exists")], workdir))
    assert code == 0, out[-4000:]
    code, out = _finish(reference)
    assert code == 0, out[-4000:]
    _assert_same_run(run, ref)


@pytest.mark.slow
def test_sigterm_to_launch_two_ranks_agree_save_and_resume(workdir: Path, reference2: Callable[[], Path]) -> None:
    cfg, run = workdir / "job.yaml", workdir / "term2"
    job = _start([*MOONRT, "launch", "-n", "2", "--timeout", "120", "--", *MOONRT, *_train(cfg, run)], workdir)
    _wait_for_step(run, 2, lambda: job.poll() is None)
    job.send_signal(signal.SIGTERM)  # the launcher forwards it to both ranks
    code, out = _finish(job)
    step = _stopped(run, out, code)
    assert f"[rank 0] moonrt train: stopped by SIGTERM after step {step}" in out
    assert "moonrt launch: 2 ranks exited after SIGTERM with exit code 75" in out
    code, out = _finish(_start([*MOONRT, "launch", "-n", "2", "--timeout", "120", "--", *MOONRT,
                                *_train(cfg, run, "--resume")], workdir))
    assert code == 0, out[-4000:]
    _assert_same_run(run, reference2())


@pytest.mark.slow
def test_second_signal_aborts_and_keeps_the_previous_checkpoint(workdir: Path) -> None:
    run = workdir / "abort"
    cfg = workdir / "every.yaml"
    cfg.write_text((workdir / "job.yaml").read_text().replace("checkpoint_every: 1000", "checkpoint_every: 1"))
    job = _start([*MOONRT, *_train(cfg, run)], workdir)
    _wait_for_step(run, 2, lambda: job.poll() is None)
    job.send_signal(signal.SIGTERM)
    job.send_signal(signal.SIGINT)  # a different signal: the kernel cannot merge it with the first
    code, out = _finish(job)
    assert code in (128 + signal.SIGTERM, 128 + signal.SIGINT), out[-4000:]
    assert re.search(r"moonrt train: second SIG(TERM|INT): aborting without a checkpoint", out), out[-4000:]
    state = store.read_state(run / "out", BUILDER)  # an earlier step's, complete
    assert 1 <= state["step"] <= _records(run)[-1]["step"]
    assert sorted(p.name for p in (run / "out").iterdir()) == ["checkpoint.pt", "config.yaml", "run_id"]  # no temp


class _SignalSelf(Part):
    """Sends this process SIGTERM from one hook of the training loop: start-up, an eval batch, or a step."""

    def __init__(self, where: str, step: int = -1) -> None:
        self.where, self.at = where, step

    def _kill(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        self.where = "done"

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.where == "start-up":
            self._kill()
        return model

    def loss_sum(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: object = None) -> None:
        if self.where == "eval":
            self._kill()

    def step_metrics(self, step: int, model: torch.nn.Module, record: dict) -> None:
        if self.where == "step" and step == self.at:
            self._kill()


@pytest.mark.slow
@pytest.mark.parametrize(("where", "stop_step", "evaluated"), [("start-up", 0, False), ("eval", 2, True),
                                                               ("step", 3, False)])
def test_stop_points_in_process(workdir: Path, tmp_path: Path, where: str, stop_step: int, evaluated: bool) -> None:
    """A signal during start-up stops before step 1 (checkpoint of step 0); during an eval, right after it
    (the eval completes); during step 3 (an eval step), after step 3 without its eval. Handlers are restored."""
    job = from_dict(JobConfig, {"data": {"corpus": str(workdir / "corpus.txt")}, "out_dir": str(tmp_path / "out"),
                                "optim": {"steps": 6, "batch_size": 2, "seq_len": 16, "eval_every": 2 if where == "eval"
                                          else 3, "eval_windows": 2, "checkpoint_every": 100}})
    metrics = tmp_path / "m.jsonl"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as info:
        train(job, rt=Parallelism(parts=[_SignalSelf(where, 2)]), metrics_path=str(metrics), progress=False)
    assert signal.getsignal(signal.SIGTERM) is before
    assert info.value.step == stop_step and info.value.signum == signal.SIGTERM
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, stop_step + 1))
    if records:
        assert ("eval_loss" in records[-1]) == evaluated
    assert store.read_state(tmp_path / "out", BUILDER)["step"] == stop_step
    train(job, metrics_path=str(metrics), resume=True, progress=False)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 7))


@pytest.mark.slow
def test_launch_kills_ranks_that_do_not_stop_within_the_grace(tmp_path: Path) -> None:
    code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(f'ready{os.environ[\"RANK\"]}', 'w').close(); time.sleep(120)")
    argv = [*MOONRT, "launch", "-n", "2", "--stop-grace", "1", "--", sys.executable, "-c", code]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1] if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "ranks [0, 1] of 2 still running --stop-grace 1 s after SIGTERM; stopped them" in err


def test_launch_exit_code_is_the_ranks() -> None:
    """Ranks that stop with 75 are no failure: the launcher waits for all and exits with 75."""
    err = io.StringIO()
    stop = "import sys; sys.exit(75)"
    assert launch([sys.executable, "-c", stop], 2, stdout=io.StringIO(), stderr=err) == PREEMPTED_EXIT
    assert "2 ranks exited with exit code 75 (75: stopped at a step boundary and checkpointed)" in err.getvalue()
    mixed = "import os, sys; sys.exit(75 if os.environ['RANK'] == '0' else 0)"
    assert launch([sys.executable, "-c", mixed], 2, stdout=io.StringIO(), stderr=io.StringIO()) == PREEMPTED_EXIT


# --------------------------------------------------------------------------------------------- sbatch --requeue


def test_requeue_script_contents() -> None:
    train = ["/venv/bin/moonrt", "train", "--out", "run"]
    text = render_sbatch(SbatchJob(command=train, nodes=1, ntasks_per_node=2, time="01:00:00", requeue=True,
                                   signal_lead_s=90))
    lines = text.splitlines()
    for directive in ("--signal=B:USR1@90", "--requeue", "--open-mode=append", "--time=01:00:00"):
        assert f"#SBATCH {directive}" in lines
    assert "trap forward USR1" in lines
    assert "srun --kill-on-bad-exit=1 --ntasks=2 --ntasks-per-node=2 \\" in lines
    assert "    /venv/bin/moonrt train --out run --signal USR1 --resume-if-exists &" in lines
    assert '  scontrol requeue "$SLURM_JOB_ID"' in lines
    assert subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True).returncode == 0
    assert "--requeue" not in render_sbatch(SbatchJob(command=train))
    # flags the command names itself are kept; other commands are not touched
    assert requeue_command([*MOONRT, "train", "--signal", "USR2", "--resume"]) == [*MOONRT, "train", "--signal",
                                                                                   "USR2", "--resume"]
    assert requeue_command(["python", "my_train.py"]) == ["python", "my_train.py"]


_TASK = """
import os, signal, sys, time
mode = sys.argv[1]
if mode == "stop":
    signal.signal(signal.SIGUSR1, lambda s, f: sys.exit(75))
elif mode == "die":
    signal.signal(signal.SIGUSR1, lambda s, f: os.kill(os.getpid(), signal.SIGTERM))
elif mode == "ignore":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
open("ready", "w").close()
if mode == "fail":
    sys.exit(3)
for _ in range(30):  # a signalled task has stopped long before (the test sends it at once)
    time.sleep(0.1)
sys.exit(0)
"""


@pytest.mark.parametrize(("mode", "signalled", "code", "requeued"),
                         [("stop", True, 0, True), ("die", True, 0, True), ("ignore", True, 0, False),
                          ("fail", False, 3, False)])
def test_requeue_script_forwards_and_requeues(tmp_path: Path, mode: str, signalled: bool, code: int,
                                              requeued: bool) -> None:
    """The script's shell logic with stand-ins: ``srun`` runs the task itself, ``scontrol`` logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$*" >> scontrol.log\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "task.py").write_text(_TASK)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(SbatchJob(command=[sys.executable, "task.py", mode], workdir=str(tmp_path),
                                              requeue=True)))
    env = {**clean_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    if signalled:
        proc.send_signal(signal.SIGUSR1)  # what `scancel --signal=USR1 --batch` does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else ""), out
    if signalled:
        assert "moonrt sbatch: SIGUSR1: forwarding it to the job step" in out


# --------------------------------------------------------------------------------------------- real SLURM


def _job_state(job_id: str) -> dict[str, str]:
    res = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", res.stdout))


def _wait_state(job_id: str, pred: Callable[[dict[str, str]], bool], what: str, log: Path,
                timeout: float = 180) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        state = _job_state(job_id)
        if pred(state):
            return state
        text = log.read_text() if log.exists() else "(no log)"
        assert state.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), f"{state}\n{text}"
        assert time.monotonic() < deadline, f"job {job_id}: not {what} after {timeout} s: {state}\n{text[-4000:]}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_requeue_resumes_and_matches(workdir: Path, reference2: Callable[[], Path]) -> None:
    require_slurm("sbatch", "scontrol", "scancel", "sinfo")
    run, log = workdir / "slurm", workdir / "slurm.log"
    submit = [*MOONRT, "sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--requeue", "--timeout", "120",
              "--job-name", "moonrt-requeue", "--log", str(log), "--output", str(workdir / "requeue.sbatch"),
              "--submit", "--", *MOONRT, *_train(workdir / "job.yaml", run)]
    res = subprocess.run(submit, cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    try:
        _wait_for_step(run, 2, lambda: _job_state(job_id).get("JobState") in ("PENDING", "RUNNING"))
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        _wait_state(job_id, lambda s: s.get("Restarts") == "1" and s.get("JobState") == "PENDING", "requeued", log)
        # A requeued job becomes eligible ~2 minutes later: let it start in 3 s. Not "now": slurmd
        # revoked the first run's credential at the requeue with a time in whole seconds, and a run
        # allocated in that same second is refused ("Job credential revoked": FAILED, exit 1, 0 s).
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"], check=True, timeout=30)
        _wait_state(job_id, lambda s: s.get("JobState") == "COMPLETED", "completed", log)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    text = log.read_text()
    step = int(re.search(r"stopped by SIGUSR1 after step (\d+) of", text).group(1))
    assert 2 <= step < STEPS, text[-4000:]
    assert f"requeueing job {job_id} (restart 0)" in text, text[-4000:]
    _assert_same_run(run, reference2())


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["train", "--signal", "KILL", "--steps", "1"], "stop_signal (--signal) = 'KILL': expected one of TERM, INT, HUP"),
     (["sbatch", "--nodes", "1", "--ntasks-per-node", "1", "--signal-lead", "30", "--", "true"],
      "--signal-lead = 30: expected together with --requeue"),
     (["sbatch", "--nodes", "1", "--ntasks-per-node", "1", "--requeue", "--signal-lead", "0", "--", "true"],
      "--signal-lead = 0: expected an integer number of seconds in [1, 65535]"),
     (["launch", "-n", "1", "--stop-grace", "0", "--", "true"], "--stop-grace = 0.0: expected a positive number")],
)
def test_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from moonrt.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_abort_swallowed_by_torch_save_still_aborts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second stop signal whose handler runs inside torch.save's zip writer (at the entry of the Python
    ``write`` it calls back, before any ``try`` there) comes out of torch as a RuntimeError ("unexpected pos
    ..."): checkpoint.save re-raises the abort (exit 128 + signum), not a "checkpoint write failed" error, and
    leaves no temp file beside the previous checkpoint."""
    from moonrt.cluster.preempt import Aborted, StopSignal
    from moonrt.jobs.checkpoint import single as checkpoint

    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"step": 1})
    stop = StopSignal([signal.SIGTERM, signal.SIGINT])

    def save_hit_by_two_signals(obj: object, f: object) -> None:
        stop._handle(signal.SIGTERM, None)  # the first: stop after this step
        try:
            stop._handle(signal.SIGINT, None)  # the second, where the C++ writer swallows what it raises
        except Aborted:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8945920 vs 8945808") \
                from None

    monkeypatch.setattr(torch, "save", save_hit_by_two_signals)
    with stop, pytest.raises(Aborted) as err:
        checkpoint.save(path, {"step": 2})
    assert err.value.exit_code == 128 + signal.SIGINT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert torch.load(path, weights_only=True) == {"step": 1}
