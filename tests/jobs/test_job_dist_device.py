"""The job config owns ``dist`` and ``device`` (issue 29 item 5): validation, the precedence of the job's ``dist``
over the launcher's environment, what reaches ``init_distributed``, what a run records, and one YAML accepted (or
refused with the same message) by both ``moonrt train --config`` and ``moonrt sbatch --config``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from jobs.helpers import _corpus

from moonrt.cli import main
from moonrt.cluster.env import resolve_dist_config
from moonrt.config import ConfigError, DistConfig, from_dict
from moonrt.jobs.train import assemble, device
from moonrt.jobs.train import cli as train_cli
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.device import bind_device, resolve_device, resolve_job

SHARED = """\
model: k3_tiny
device: cpu
parallel:
  ep: 2
dist:
  backend: gloo
  timeout_s: 45
  rdzv_host: 10.0.0.1
"""


def _train_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_device_resolution() -> None:
    assert resolve_device("cpu", cuda=False) == resolve_device("cpu", cuda=True) == "cpu"
    assert resolve_device("auto", cuda=False) == "cpu"
    assert resolve_device("auto", cuda=True) == resolve_device("cuda", cuda=True) == "cuda"
    with pytest.raises(ConfigError, match=r"^device \(--device\) = 'cuda': CUDA is not available here .*expected "
                                          r"'cpu' or 'auto'$"):
        resolve_device("cuda", cuda=False)


def test_backend_follows_the_device() -> None:
    """auto: gloo on cpu, nccl on cuda; nccl on cpu refused; gloo on cuda allowed for one process (no group), refused
    for a multi-rank job (its collectives reduce GPU tensors)."""
    gloo = from_dict(JobConfig, {"dist": {"backend": "gloo"}})
    assert resolve_job(JobConfig(), {}, cuda=True).dist.backend == "nccl"
    assert resolve_job(JobConfig(), {}, cuda=False).dist.backend == "gloo"
    assert resolve_job(gloo, {}, cuda=True).device == "cuda"
    with pytest.raises(ConfigError, match=r"^dist.backend = 'gloo': expected 'nccl' or 'auto' with device 'auto' in a "
                                          r"multi-rank job \(runs on cuda"):
        resolve_job(gloo, {}, cuda=True, multi_rank=True)
    assert resolve_job(gloo, {}, cuda=False, multi_rank=True).dist.backend == "gloo"


def test_bind_device_is_the_local_rank_gpu(monkeypatch) -> None:
    """cuda: ``cuda:LOCAL_RANK`` (modulo the GPUs seen) made current before the group is joined; cpu: the CPU."""
    import torch

    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert bind_device("cuda", env) == torch.device("cuda", 1) and current == [1]
    assert bind_device("cpu", env) == torch.device("cpu") and current == [1]
    assert bind_device("cuda", {}) == torch.device("cuda", 0) and current == [1, 0]  # one process: local rank 0


@pytest.mark.parametrize(
    ("data", "message"),
    [({"device": "gpu"}, r"^device = 'gpu': expected one of 'auto', 'cpu', 'cuda'$"),
     ({"dist": {"backend": "mpi"}}, r"^dist.backend = 'mpi': expected one of 'auto', 'gloo', 'nccl'$"),
     ({"dist": {"timeout_s": 0}}, r"^dist.timeout_s = 0.0: expected a positive number of seconds <= 604800"),
     ({"dist": {"timeout_s": ".inf"}}, r"^dist.timeout_s = '.inf': expected a number or null$"),
     ({"dist": {"rdzv_host": "a b"}}, r"^dist.rdzv_host = 'a b': expected an IP address or host name"),
     ({"dist": {"port": 1}}, r"^dist.port: unknown key in DistConfig; expected one of backend, rdzv_host, timeout_s$"),
     ({"device": "cpu", "dist": {"backend": "nccl"}}, r"^dist.backend = 'nccl': expected 'gloo' or 'auto' with "
                                                      r"device 'cpu'")],
)
def test_fields_are_validated_naming_the_field(data, message) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(JobConfig, data)


def test_dist_precedence_config_then_launcher_then_default() -> None:
    env = {"MOONRT_DIST_TIMEOUT": "60"}
    assert resolve_dist_config(DistConfig(timeout_s=20.0), env).timeout_s == 20.0  # the job's value wins
    assert resolve_dist_config(DistConfig(), env).timeout_s == 60.0  # null: the launcher's
    assert resolve_dist_config(DistConfig(), {}).timeout_s == 300.0  # neither: the default
    with pytest.raises(ConfigError, match=r"^MOONRT_DIST_TIMEOUT = '1e7': expected a positive number of seconds "
                                          r"\(finite, at most 604800\)$"):  # the same bound as dist.timeout_s
        resolve_dist_config(DistConfig(), {"MOONRT_DIST_TIMEOUT": "1e7"})
    resolve_dist_config(DistConfig(timeout_s=5.0), {"MOONRT_DIST_TIMEOUT": "bad"})  # not needed, not read
    job = resolve_job(JobConfig(), env, cuda=False)
    assert (job.device, job.dist.backend, job.dist.timeout_s, job.dist.rdzv_host) == ("cpu", "gloo", 60.0, None)
    with pytest.raises(ConfigError, match=r"^dist.backend = 'nccl': expected 'gloo' or 'auto' with device 'auto' "
                                          r"\(runs on cpu"):
        resolve_job(from_dict(JobConfig, {"dist": {"backend": "nccl"}}), env, cuda=False)


def test_flags_set_device_and_dist_timeout(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(SHARED)
    job = train_cli.job_from_args(_train_args("--config", str(cfg), "--dist-timeout", "12", "--device", "auto"))
    assert (job.device, job.dist.timeout_s, job.dist.backend) == ("auto", 12.0, "gloo")
    with pytest.raises(ConfigError, match=r"^dist.timeout_s \(--dist-timeout\) = -1.0: expected a positive number"):
        train_cli.job_from_args(_train_args("--dist-timeout", "-1"))


def test_parallel_runtime_passes_the_jobs_dist_to_init_distributed(monkeypatch) -> None:
    """The job's dist reaches init_distributed as its argument: the config's timeout over the launcher's, the
    backend resolved for the device; a device that cannot run fails before any rendezvous."""
    import moonrt.cluster.env as env

    seen = []

    class Joined(Exception):
        pass

    def fake_init(cfg=None):
        seen.append(cfg)
        raise Joined

    monkeypatch.setattr(env, "init_distributed", fake_init)
    monkeypatch.setattr(device, "cuda_available", lambda: False)  # a machine without CUDA, on a GPU node too
    monkeypatch.setenv("MOONRT_DIST_TIMEOUT", "60")
    with pytest.raises(Joined):
        assemble.parallel_runtime(from_dict(JobConfig, {"dist": {"timeout_s": 20}}))
    with pytest.raises(Joined):
        assemble.parallel_runtime(JobConfig())
    assert [(c.backend, c.timeout_s) for c in seen] == [("gloo", 20.0), ("gloo", 60.0)]
    with pytest.raises(ConfigError, match=r"^device \(--device\) = 'cuda'"):
        assemble.parallel_runtime(from_dict(JobConfig, {"device": "cuda"}))
    assert len(seen) == 2


def test_cuda_request_is_one_line_and_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(device, "cuda_available", lambda: False)  # a machine without CUDA, on a GPU node too
    code = main(["train", "--device", "cuda", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("moonrt train: error: device (--device) = 'cuda': "), err
    assert not (tmp_path / "run").exists()


def test_run_records_resolved_device_and_dist(tmp_path: Path, capsys, monkeypatch) -> None:
    """``auto`` without CUDA runs on the CPU; the start line and config.yaml name the device it used."""
    monkeypatch.setattr(device, "cuda_available", lambda: False)  # a machine without CUDA, on a GPU node too
    monkeypatch.setenv("MOONRT_DIST_TIMEOUT", "77")
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16", "--steps", "1",
                 "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    start = [line for line in stdout.splitlines() if line.startswith("moonrt train: k3_tiny (")]
    assert len(start) == 1 and start[0].endswith("; device cpu"), stdout
    rec = yaml.safe_load((out / "config.yaml").read_text())
    assert rec["device"] == "cpu"
    assert rec["dist"] == {"backend": "gloo", "timeout_s": 77.0, "rdzv_host": None}


@pytest.mark.skipif(not device.cuda_available(), reason="needs a CUDA device")
def test_auto_trains_on_the_gpu(tmp_path: Path, capsys) -> None:
    """Where CUDA is available ``auto`` trains on ``cuda:0`` (one process): the start line and config.yaml say so."""
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16", "--steps", "1",
                 "--out", str(out)]) == 0
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("moonrt train: k3_tiny (")]
    assert len(start) == 1 and start[0].endswith("; device cuda:0"), start
    assert yaml.safe_load((out / "config.yaml").read_text())["device"] == "cuda"


def test_one_yaml_for_train_and_sbatch(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(SHARED)
    job = train_cli.job_from_args(_train_args("--config", str(cfg)))
    assert (job.device, job.parallel.ep, job.dist) == ("cpu", 2, DistConfig(backend="gloo", timeout_s=45.0,
                                                                             rdzv_host="10.0.0.1"))
    script = tmp_path / "job.sbatch"
    assert main(["sbatch", "--nodes", "2", "--ntasks-per-node", "2", "--config", str(cfg), "--output", str(script),
                 "--", "true"]) == 0, capsys.readouterr().err
    lines = script.read_text().splitlines()
    assert "export MOONRT_DIST_TIMEOUT=45" in lines and "export MOONRT_RDZV_HOST=10.0.0.1" in lines
    assert lines[-1].endswith(f"true --config {cfg.resolve()}")
    capsys.readouterr()

    bad = tmp_path / "bad.yaml"
    bad.write_text(SHARED.replace("timeout_s: 45", "timeout_s: -5"))
    assert main(["train", "--config", str(bad), "--no-progress"]) == 2
    train_err = capsys.readouterr().err.strip()
    assert main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--config", str(bad), "--", "true"]) == 2
    sbatch_err = capsys.readouterr().err.strip()
    prefix_train, prefix_sbatch = "moonrt train: error: ", "moonrt sbatch: "
    assert train_err.startswith(prefix_train) and sbatch_err.startswith(prefix_sbatch)
    message = train_err[len(prefix_train):]
    assert message == sbatch_err[len(prefix_sbatch):]
    assert message.startswith(f"{bad}: dist.timeout_s = -5.0: expected a positive number of seconds"), message
