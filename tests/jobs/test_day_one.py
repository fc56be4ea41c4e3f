"""What a new user meets on day one (issue 36): the written-out default config, the README's "Other runs" lines
after the quick start, honest summaries of stopped and resumed runs, and a stop signal that arrives while
``moonrt train`` is still importing torch."""

from __future__ import annotations

from pathlib import Path

from moonrt.config import load_yaml, read_yaml, to_dict
from moonrt.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def test_k3_tiny_yaml_is_the_embedded_default() -> None:
    path = ROOT / "configs" / "k3_tiny.yaml"
    assert to_dict(load_yaml(JobConfig, path)) == to_dict(JobConfig())
    assert read_yaml(path) == to_dict(JobConfig()), "configs/k3_tiny.yaml must write out every key of JobConfig()"
