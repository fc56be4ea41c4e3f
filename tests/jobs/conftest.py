"""Runs that several ``moonrt train`` tests compare against, made once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from jobs.helpers import FLAGS, _here, _run


@pytest.fixture(scope="session")
def single_process_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``base/`` (one process, ``test_pp_train.FLAGS``, trained to step 1 and checkpointed) and
    ``single/`` (a copy of ``base`` resumed for step 2, metrics in ``single.jsonl``): the checkpoint each layout of
    ``test_pp_train`` and ``test_zero_train`` resumes and the single-process step it must equal. Read only:
    tests copy what they resume or continue. Both run in this process (:func:`test_pp_train._here`)."""
    root = tmp_path_factory.mktemp("single_process_steps")
    _run(root, {"base": _here("train", *FLAGS, "--until", "1", "--out", "base")})
    shutil.copytree(root / "base", root / "single")
    _run(root, {"single": _here("train", *FLAGS, "--resume", "--until", "2", "--out", "single", "--metrics",
                                "single.jsonl")})
    return root
