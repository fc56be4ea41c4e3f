"""Every file moonrt writes has the mode a plain ``open()`` / ``mkdir`` would give under the caller's umask, so a
colleague's eval job or another uid in the group can read the outputs it is meant to read (issue 49 item 3: temp files
from ``mkstemp`` are 0600 and ``mkdtemp`` directories 0700 until moonrt sets the umask's mode).

Run under umask 027 (not the usual 022, so a file that merely kept a default would show): every file must be 0640 and
every directory 0750, per output kind: a one-process run (checkpoint.pt, config.yaml, metrics, run id, lock), a
sharded checkpoint (convert), a converted ``.pt``, a single-file export and a Hugging Face export directory.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

UMASK = 0o027


def _moonrt(cwd: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "moonrt.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, preexec_fn=lambda: os.umask(UMASK))
    assert done.returncode == 0, done.stderr[-3000:]


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.slow
def test_every_output_kind_has_the_umasks_mode(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    _moonrt(tmp_path, "train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--corpus", str(corpus),
            "--set", "optim.eval_windows=1", "--out", "run", "--metrics", "run/metrics.jsonl", "--no-progress")
    _moonrt(tmp_path, "checkpoint", "convert", "run/checkpoint.pt", "sharded")
    _moonrt(tmp_path, "checkpoint", "convert", "sharded", "back.pt")
    _moonrt(tmp_path, "checkpoint", "export", "run", "weights.safetensors")
    _moonrt(tmp_path, "checkpoint", "export", "run", "hf", "--format", "hf")
    outputs = {name: _modes(tmp_path / name) for name in ("run", "sharded", "back.pt", "weights.safetensors", "hf")}
    assert (tmp_path / "run" / "checkpoint.pt").is_file() and (tmp_path / "hf" / "config.json").is_file()
    assert any(n.endswith(".distcp") for n in outputs["sharded"]), outputs["sharded"]
    want = {True: 0o777 & ~UMASK, False: 0o666 & ~UMASK}  # is a directory -> mode
    wrong = {f"{kind}/{name}": oct(mode) for kind, modes in outputs.items() for name, mode in modes.items()
             if mode != want[(tmp_path / kind / name).is_dir()]}
    assert not wrong, wrong
