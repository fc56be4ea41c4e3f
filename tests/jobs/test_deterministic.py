"""``JobConfig.deterministic`` (``--deterministic``, issue 47 item 5): the opt-in deterministic mode a GPU ``--resume``
needs to be bit-identical (``torch.use_deterministic_algorithms`` and cuBLAS's fixed workspace); the CPU is
deterministic either way. What is checked here, on CPU: the flag and the YAML key set the field and the run records
it, the switch turns both settings on before the job computes and leaves a user's own cuBLAS setting alone, and a
k3_tiny step trains under it (every op the step uses has a deterministic implementation)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import yaml
from jobs.helpers import _corpus

from moonrt.cli import main
from moonrt.jobs.train import cli as train_cli
from moonrt.jobs.train import device
from moonrt.jobs.train.device import CUBLAS_WORKSPACE, use_deterministic


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _job(*argv: str):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.job_from_args(parser.parse_args(list(argv)))


def test_flag_and_key_set_the_field(tmp_path: Path) -> None:
    assert _job().deterministic is False
    assert _job("--deterministic").deterministic is True
    cfg = tmp_path / "job.yaml"
    cfg.write_text("deterministic: true\n")
    assert _job("--config", str(cfg)).deterministic is True
    assert _job("--set", "deterministic=true").deterministic is True


def test_switch_turns_on_torch_and_cublas(restore_determinism) -> None:
    torch.use_deterministic_algorithms(False)
    env: dict[str, str] = {}
    use_deterministic(False, env)
    assert env == {} and not torch.are_deterministic_algorithms_enabled()
    use_deterministic(True, env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE} and torch.are_deterministic_algorithms_enabled()
    own = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the user's (also reproducible) choice is kept
    use_deterministic(True, own)
    assert own == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


@pytest.mark.slow
def test_a_k3_tiny_step_trains_deterministic_and_records_it(tmp_path: Path, capsys, monkeypatch,
                                                            restore_determinism) -> None:
    """The job switches the mode on before it computes (seen from inside the step) and config.yaml records it."""
    torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []
    build = torch.nn.Module.__call__

    def call(mod, *args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return build(mod, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", call)
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16", "--steps", "1",
                 "--eval-every", "100", "--out", str(out), "--no-progress", "--deterministic"]) == 0

    assert seen and all(seen)
    assert yaml.safe_load((out / "config.yaml").read_text())["deterministic"] is True
