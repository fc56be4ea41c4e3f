"""The README walked as a new user walks it (issue 36): every command of every ``bash`` block, in the README's order,
in one fresh directory, so the README cannot drift from the code again.

What the walk changes, all listed here and nothing else:

- **Size.** Every ``moonrt train`` runs ``--steps 2`` (``--until N`` -> ``--until 1``: the README's stop-and-resume
  pair still stops after step 1 and resumes to step 2) and its final eval reads one default batch of held-out windows
  (``--set optim.eval_windows=8``, not 32: every data-parallel replica evaluates all of them, and 32 were ~40% of a
  two-step run); every self-test runs its smallest sizes (:data:`SELFTEST_SMALL`)
  and SLURM steps ``srun -n N`` run 2 tasks. Layouts keep their rank counts (``launch -n 8 ... --pp 2 --ep 2 --zero 1``
  still runs 8 ranks: the layout is what the line documents).
- **Notation.** ``[--json]`` (optional flags) runs with the flag; ``hf|moonrt`` (alternatives) runs the first.
- **The user's own files** the README assumes (:func:`_user_files`): ``book.txt`` (a text), ``tokens.bin`` (uint16
  ids below the custom config's vocabulary), ``train.py`` (a program joining its job with
  ``moonrt.cluster.init_distributed`` and checking an all-reduce), ``job.yaml`` (the repo's ``configs/k3_tiny.yaml``),
  and each ``yaml`` block whose first line names its file (``# policy.yaml -- ...``); the repo's ``configs/`` are
  copied in, as a clone has them.
- **Start-up.** The README's first command runs the installed ``.venv/bin/moonrt`` console script in a new
  interpreter; every later one-process ``moonrt ...`` command runs ``moonrt.cli.main`` (what that script runs) with
  the same arguments, working directory and environment in a process forked from one that imported torch once
  (``tests/forkrun.py``: each command still imports moonrt itself; ~3-4 s of imports saved per command on 2 cores).
  Every other program (``srun``, ``torchrun``, ``python ...``) and every rank a ``moonrt launch`` starts is a new
  process, as the README runs it.
- **Not run** (:data:`NOT_RUN`, each with its reason; every entry must match a README command, so the table cannot go
  stale): the install commands (this test runs inside that install) and the test command itself, and the
  ``moonrt sbatch --submit`` of a 2-node job (this machine's SLURM has one node), and the lines of *Running on
  several nodes*, each one node's part of a 2-node job (run across the cluster in a box by
  ``tests/cluster/test_cluster_box.py``).

SLURM lines need the single-node SLURM of ``.ci/slurm-ci.sh``: they are skipped with the reason where it is absent,
and fail instead under ``MOONRT_REQUIRE_CLUSTER=1`` (CI).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cluster.helpers import clean_env, require_slurm
from forkrun import Server

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TIMEOUT_S = 300

NOT_RUN = {
    "python3 -m venv .venv": "installs moonrt: this test runs inside that install",
    ".venv/bin/pip install -q -c constraints.txt -e .": "installs moonrt: this test runs inside that install",
    ".venv/bin/pip install -q -c constraints.txt -e '.[test,mpi]'":
        "installs moonrt: this test runs inside that install",
    ".venv/bin/ruff check .": "the README's test command: it is running this test",
    ".venv/bin/mypy": "the README's test command: it is running this test",
    ".venv/bin/python -m pytest -q -n auto --dist loadgroup": "the README's test command: it is running this test",
    "moonrt sbatch --nodes 2 --ntasks-per-node 4 --config job.yaml --submit -- python train.py":
        "submits a 2-node job; this machine's SLURM has one node",
    **{cmd: "one node of a 2-node job at 10.0.0.1 / node1,node2: this machine is one host (these launchers run across "
            "the 2 nodes of .ci/cluster-box.sh in tests/cluster/test_cluster_box.py)" for cmd in (
        "moonrt launch -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --rdzv-id run42 -- moonrt train --config "
        "job.yaml",
        "moonrt launch -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --rdzv-id run42 -- moonrt train --config "
        "job.yaml",
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id run42 "
        "--no-python moonrt train --config job.yaml",
        "moonrt sbatch -N 2 --ntasks-per-node 8 --requeue --config job.yaml --submit -- moonrt train",
        "mpiexec -hosts node1,node2 -ppn 8 -n 16 python -m moonrt.jobs.selftest --suite collectives,ep")},
}
"""Commands shown but not run, with the reason (keys are the commands as the README writes them)."""

EXIT_CODES = {
    ".venv/bin/moonrt mem-plan": (1, "does not fit 80 GiB"),
    ".venv/bin/moonrt mem-plan --shard-grads --budget-gib 80 --out runs/mem-plan": (1, "80 GiB does not fit"),
}
"""Commands whose documented outcome is a non-zero exit (mem-plan: exit 1 when a budget does not fit), with the
exit code and a phrase the output must hold."""

EVAL_WINDOWS = "optim.eval_windows=8"
"""The eval size of every walked ``moonrt train`` (module docstring)."""

SELFTEST_SMALL = ["--sizes", "4K", "--iters", "1", "--ep-shapes", "32x16x2x64", "--ep-maxvio", "0,16", "--ep-ffn", "8",
                  "--kcp-tokens", "64", "--kcp-shape", "1x2x8x12", "--pp-sizes", "1K", "--remote-sizes", "4K"]
"""The self-test's smallest sizes (one of each kind), appended to every self-test the README runs."""


@dataclass(frozen=True)
class Command:
    """One shell command of a README ``bash`` block (a ``&&`` chain is split into its commands)."""
    line: int    # README line where it starts
    text: str    # as written (continuations joined, comment dropped)
    argv: tuple[str, ...]


def readme_commands(text: str) -> list[Command]:
    """Every command of every ```` ```bash ```` block, in order."""
    out: list[Command] = []
    lines = text.splitlines()
    i, in_bash = 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_bash = not in_bash and line.strip() == "```bash"
            i += 1
            continue
        if not in_bash or not line.strip():
            i += 1
            continue
        start = i
        while line.rstrip().endswith("\\"):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        tokens = shlex.split(line, comments=True)
        i += 1
        chain: list[str] = []
        for tok in [*tokens, "&&"]:
            if tok == "&&":
                if chain:
                    out.append(Command(start + 1, shlex.join(chain), tuple(chain)))
                chain = []
            else:
                chain.append(tok)
    return out


def _is(argv: tuple[str, ...] | list[str], *words: str) -> bool:
    """``argv`` runs ``moonrt WORDS...`` (as ``moonrt``, ``.venv/bin/moonrt`` or ``python -m moonrt.cli``)."""
    return any(Path(a).name == "moonrt" and list(argv[i + 1:i + 1 + len(words)]) == list(words)
               for i, a in enumerate(argv))


def walk_argv(argv: tuple[str, ...]) -> list[str]:
    """The command the walk runs for a README command (module docstring: size and notation, nothing else)."""
    out: list[str] = []
    for a in argv:
        a = a.removeprefix("[").removesuffix("]")
        if "|" in a and not a.startswith("-"):
            a = a.split("|")[0]
        out.append(a)
    train = _is(out, "train")
    if train:
        for flag, small in (("--steps", "2"), ("--until", "1")):
            for j, a in enumerate(out[:-1]):
                if a == flag:
                    out[j + 1] = small
        if "--steps" not in out:
            out += ["--steps", "2"]
        if not any(a.startswith("optim.eval_windows=") for a in out):
            out += ["--set", EVAL_WINDOWS]
    if out[0] == "srun":
        out[out.index("-n") + 1] = "2"
    if "--selftest" in out or _is(out, "selftest") or "moonrt.jobs.selftest" in out:
        if "--selftest" in out and "--" not in out:
            out.append("--")
        out += SELFTEST_SMALL
    return out


def _user_files(here: Path, text: str) -> None:
    """The files the README assumes a user has (module docstring)."""
    shutil.copytree(ROOT / "configs", here / "configs")
    (here / ".venv").symlink_to(Path(sys.executable).parent.parent)
    rng = np.random.default_rng(0)
    words = ["the", "model", "routes", "each", "token", "to", "two", "experts", "and", "a", "shared", "one"]
    (here / "book.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) + "." for _ in range(3000)))
    rng.integers(0, 1024, 200_000).astype(np.uint16).tofile(here / "tokens.bin")
    shutil.copy(ROOT / "configs" / "k3_tiny.yaml", here / "job.yaml")
    (here / "train.py").write_text(
        "import torch, torch.distributed as dist\n"
        "from moonrt.cluster import init_distributed\n"
        "r = init_distributed()\n"
        "x = torch.tensor([float(r.rank + 1)])\n"
        "dist.all_reduce(x)\n"
        "assert x.item() == r.world_size * (r.world_size + 1) / 2, x\n"
        "print(f'rank {r.rank} of {r.world_size}: all_reduce ok')\n"
        "dist.destroy_process_group()\n")
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
        name = re.match(r"#\s*(\S+\.ya?ml)\s", block)
        if name:
            (here / name.group(1)).write_text(block)


def test_the_walk_covers_every_command_and_its_rules_hold() -> None:
    """Every not-run entry names a README command; the size rules do what the docstring says."""
    cmds = readme_commands(README.read_text())
    texts = [c.text for c in cmds]
    for key in [*NOT_RUN, *EXIT_CODES]:
        assert key in texts, f"NOT_RUN / EXIT_CODES entry {key!r} matches no README command"
    ran = [c for c in cmds if c.text not in NOT_RUN]
    assert sum(_is(c.argv, "train") for c in ran) >= 20, "fewer train commands than the README has: parser broken?"
    pair = next(c for c in ran if "--until" in c.argv)
    small = walk_argv(pair.argv)
    assert small[small.index("--steps") + 1] == "2" and small[small.index("--until") + 1] == "1", small
    assert walk_argv(("moonrt", "launch", "-n", "2", "--", "moonrt", "train", "--pp", "2"))[-4:] == \
        ["--steps", "2", "--set", EVAL_WINDOWS]
    assert walk_argv(("moonrt", "train"))[-4:] == ["--steps", "2", "--set", EVAL_WINDOWS]
    assert walk_argv(("moonrt", "checkpoint", "export", "runs/a", "w.st", "[--names", "hf|moonrt]")) == \
        ["moonrt", "checkpoint", "export", "runs/a", "w.st", "--names", "hf"]
    assert walk_argv(("srun", "-n", "16", "moonrt", "selftest"))[:3] == ["srun", "-n", "2"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_readme_command_runs_in_order(tmp_path: Path) -> None:
    text = README.read_text()
    here = tmp_path / "walk"
    here.mkdir()
    _user_files(here, text)
    before = set(os.listdir(here))
    env = {**clean_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MOONRT_DIST_TIMEOUT": "120"}
    timings: list[tuple[float, str]] = []
    server, script_ran = Server(env), False
    try:
        for cmd in readme_commands(text):
            if cmd.text in NOT_RUN:
                continue
            argv = walk_argv(cmd.argv)
            if argv[0] == "srun":
                require_slurm("srun", "sinfo")
                argv = ["timeout", "240", *argv[:1], "-I60", "--kill-on-bad-exit=1", *argv[1:]]
            forked = Path(argv[0]).name == "moonrt" and script_ran  # the first one runs the console script itself
            script_ran = script_ran or Path(argv[0]).name == "moonrt"
            t0 = time.perf_counter()
            if forked:
                code, stdout, stderr = server.run(argv[1:], here, TIMEOUT_S)
            else:
                res = subprocess.run(argv, cwd=here, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
                code, stdout, stderr = res.returncode, res.stdout, res.stderr
            timings.append((time.perf_counter() - t0, cmd.text))
            print(f"{timings[-1][0]:6.1f} s  README line {cmd.line}{' (forked)' if forked else ''}: {cmd.text}",
                  flush=True)
            rc, phrase = EXIT_CODES.get(cmd.text, (0, ""))
            assert code == rc and phrase in stdout + stderr, (
                f"README line {cmd.line}: {cmd.text}\nran: {shlex.join(argv)}\nexit {code}, expected {rc}"
                f"{f' and {phrase!r} in the output' if phrase else ''}\n"
                f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}")
    finally:
        server.close()
    # what the walk made is what the README says it makes
    assert (here / "runs" / "a").is_dir() and (here / "runs" / "w.safetensors").is_file()
    assert (here / "runs" / "routing.npz").is_file() and (here / "runs" / "selftest.json").is_file()
    # every README command writes under runs/ (ignored by .gitignore): nothing else appears beside the checkout's files
    assert set(os.listdir(here)) - before <= {"runs"}, sorted(set(os.listdir(here)) - before)
    print(f"{len(timings)} commands in {sum(t for t, _ in timings):.0f} s")


OUTPUT_FLAGS = ("--out", "--metrics", "--report", "--json", "--tensorboard", "--routing-trace", "--output",
                "--profile-out")
"""The flags of moonrt's commands whose value is a path the command creates."""


def readme_outputs(cmds: list[Command]) -> list[str]:
    """The paths the README's commands create: the values of :data:`OUTPUT_FLAGS`, ``checkpoint export`` /
    ``convert``'s destination, and the script ``sbatch --submit`` keeps without ``--output``
    (``./<job-name>-<job id>.sbatch``)."""
    out = []
    for cmd in cmds:
        argv = walk_argv(cmd.argv)
        out += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in OUTPUT_FLAGS and not argv[i + 1].startswith("-")]
        for verb in ("export", "convert"):
            if _is(argv, "checkpoint", verb):
                at = next(i for i, a in enumerate(argv) if Path(a).name == "moonrt") + 3
                out.append(argv[at + 1])
        if _is(argv, "sbatch") and "--submit" in argv and "--output" not in argv:
            out.append("moonrt-1234.sbatch")
    return out


def test_readme_commands_write_under_runs_or_what_gitignore_covers() -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git (git check-ignore)")
    paths = readme_outputs(readme_commands(README.read_text()))
    assert "runs/a" in paths and "runs/w.safetensors" in paths and "moonrt-1234.sbatch" in paths, paths
    outside = [p for p in paths if Path(p).parts[0] != "runs"]
    assert outside, "no README output outside runs/: nothing left for .gitignore to cover"
    res = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v", "-n"], input="\n".join(paths),
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    unmatched = [line.split("\t")[-1] for line in res.stdout.splitlines() if line.startswith("::")]
    assert res.returncode in (0, 1) and not unmatched, (unmatched, res.stderr)
