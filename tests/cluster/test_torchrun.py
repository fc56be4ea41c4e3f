"""Real ``torchrun`` (issue 36 item 1): moonrt's ranks join through torchrun's own rendezvous store.

torchrun's agent already serves a store on ``MASTER_PORT`` and tells its workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``); moonrt's rank 0 used to open its own store there and every
run failed with ``cannot open the rendezvous store on 127.0.0.1:PORT: Address already in use``.
These tests run the real ``torchrun`` (the one beside this interpreter) with 2 processes,
``--standalone`` and ``--rdzv-backend c10d``; the other launchers' tests only set variables.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster.helpers import clean_env

from moonrt.cluster import detect
from moonrt.cluster.launch import launch
from moonrt.cluster.network import free_port
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun beside {sys.executable} ({TORCHRUN})")


def _torchrun(launch: list[str], command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    res = subprocess.run([str(TORCHRUN), *launch, "--nproc-per-node", "2", *command], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    return res


def _shown(res: subprocess.CompletedProcess) -> str:
    return f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"


@pytest.mark.slow  # a torchrun job of new interpreters: CI runs it, the fast lane need not
def test_selftest_under_torchrun_standalone(tmp_path: Path) -> None:
    res = _torchrun(["--standalone"], ["-m", "moonrt.jobs.selftest", "--suite", "collectives", "--sizes", "4K",
                                       "--iters", "1"], tmp_path)
    assert res.returncode == 0, _shown(res)
    assert "moonrt selftest: 2 ranks via torchrun" in res.stdout, _shown(res)
    assert "moonrt selftest: PASS: 2 ranks" in res.stdout, _shown(res)
    assert "Address already in use" not in res.stderr


@pytest.mark.slow
def test_train_ep2_under_torchrun_c10d(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    out = tmp_path / "run"
    res = _torchrun(["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"],
                    ["--no-python", sys.executable, "-m", "moonrt.cli", "train", "--ep", "2", "--steps", "1",
                     "--corpus", str(corpus), "--batch-size", "2", "--seq-len", "16", "--no-progress",
                     "--out", str(out)], tmp_path)
    assert res.returncode == 0, _shown(res)
    assert "Address already in use" not in res.stderr
    # EP shards the optimizer state: the job commits a sharded (DCP) checkpoint, at its one step
    step = checkpoint_dcp.resolve(out / checkpoint_dcp.ROOT)
    assert step.name == "step-00000001", step
    assert json.loads((step / checkpoint_dcp.MARKER).read_text())["step"] == 1


def test_only_torchruns_workers_use_the_agent_store() -> None:
    """torchrun's workers (``TORCHELASTIC_USE_AGENT_STORE=True``, as torch 2.13's torchrun sets for every rendezvous
    backend) connect to its store; the same ``RANK``/``MASTER_*`` set by hand or by ``moonrt launch`` do not."""
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    rdzv = detect.detect_rendezvous(base)
    assert not detect.uses_agent_store(rdzv, base)
    assert detect.uses_agent_store(rdzv, {**base, detect.AGENT_STORE_ENV: "True"})
    assert not detect.uses_agent_store(rdzv, {**base, detect.AGENT_STORE_ENV: "False"})
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7",
             "SLURM_STEP_NODELIST": "localhost", detect.AGENT_STORE_ENV: "True"}
    assert not detect.uses_agent_store(detect.detect_rendezvous(slurm), slurm)


def test_moonrt_launch_inside_a_torchrun_worker_is_its_own_job(monkeypatch) -> None:
    """``moonrt launch`` run from a torchrun worker does not pass torchrun's variables on: its ranks would wait for
    a store torchrun serves elsewhere (and name torchrun's run as their job)."""
    for k, v in {detect.AGENT_STORE_ENV: "True", "TORCHELASTIC_RUN_ID": "outer", "TORCHELASTIC_RESTART_COUNT": "0"
                 }.items():
        monkeypatch.setenv(k, v)
    code = "import os; print('elastic', sorted(k for k in os.environ if k.startswith('TORCHELASTIC_')))"
    out, err = io.StringIO(), io.StringIO()
    assert launch([sys.executable, "-c", code], 2, timeout_s=30, stdout=out, stderr=err) == 0, err.getvalue()
    assert sorted(out.getvalue().splitlines()) == [f"[rank {r}] elastic []" for r in range(2)]
