"""The job CLIs against unbounded or out-of-range input (issue 28): ``moonrt train`` / ``moonrt sbatch`` with a YAML
alias bomb or deep nesting, numeric flags out of range (``--threads 5000``, ``--batch-size 1000000000``, ``--lr
inf``, ``--seed -1``, a seed past int64), the text corpus memory-mapped, not read whole, and the outputs of
``mem-plan`` / ``pp-plan`` / ``ep-sim`` created exclusively (``--force`` to replace, never through a symlink).

Every refusal is one line on stderr naming the field or flag, exit 2, before any work: nothing is written. Cases
that crashed or ran away before the fix (a segfault, an allocation of a terabyte, an exponential repr) run in a
subprocess under an address-space limit, so the old behaviour fails the test instead of the test process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moonrt.cli import main

# Runs `moonrt.cli.main(argv)` after importing the command's module (torch included), with the address space
# limited to what the process holds then plus 1 GiB: a command that tries to build gigabytes fails fast (MemoryError)
# rather than swapping the machine; a normal refusal needs a few MiB.
LIMITED = textwrap.dedent("""
    import importlib, resource, sys
    from moonrt.cli import COMMANDS, main
    importlib.import_module(COMMANDS[sys.argv[1]][0])
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
    sys.exit(main(sys.argv[1:]))
""")


def run_limited(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    # the timeout only guards against a hang (the old sbatch); a refusal takes seconds
    return subprocess.run([sys.executable, "-c", LIMITED, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)


def one_line(err: str, prefix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    return lines[0]


def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    if not path.exists():
        path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return path


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "--corpus", str(corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16", "--steps", "1",
            "--out", str(tmp_path / "out"), "--no-progress", *extra]


def alias_bomb(levels: int = 9) -> str:
    """A "billion laughs" list: 9**levels strings once expanded, under 500 bytes written."""
    items = ["&a0 [" + ",".join(['"lol"'] * 9) + "]"]
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


# ---- 1. bounded YAML ----------------------------------------------------------------------------------------------

def test_train_config_alias_bomb_is_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"optim:\n  muon_adamw_modules: {alias_bomb()}\n")
    res = run_limited(tmp_path, *train_args(tmp_path, "--config", str(bomb)))
    assert res.returncode == 2, res.stderr[-2000:]
    line = one_line(res.stderr, "moonrt train: error: config file ")
    assert str(bomb) in line and "YAML_MAX_NODES" in line
    assert not (tmp_path / "out").exists()


def test_sbatch_config_alias_bomb_does_not_hang(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"parallel:\n  dp: {alias_bomb()}\n")
    script = tmp_path / "job.sbatch"
    res = run_limited(tmp_path, "sbatch", "--nodes", "1", "--ntasks-per-node", "1", "--config", str(bomb),
                      "--output", str(script), "--", "true")
    assert res.returncode == 2, res.stderr[-2000:]
    line = one_line(res.stderr, "moonrt sbatch: config file ")
    assert str(bomb) in line and "YAML_MAX_NODES" in line
    assert not script.exists()


def test_train_config_deep_nesting_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("optim:\n  seed: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(train_args(tmp_path, "--config", str(deep))) == 2
    line = one_line(capsys.readouterr().err, "moonrt train: error: config file ")
    assert str(deep) in line and "YAML_MAX_DEPTH" in line
    assert not (tmp_path / "out").exists()


def test_sbatch_config_deep_nesting_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("parallel:\n  dp: " + "[" * 5000 + "]" * 5000 + "\n")
    script = tmp_path / "job.sbatch"
    assert main(["sbatch", "--nodes", "1", "--ntasks-per-node", "1", "--config", str(deep), "--output", str(script),
                 "--", "true"]) == 2
    assert "YAML_MAX_DEPTH" in one_line(capsys.readouterr().err, "moonrt sbatch: config file ")
    assert not script.exists()


# ---- 2. numeric flags range-checked before any work, naming the field --------------------------------------------

def test_threads_5000_refused_not_a_segfault(tmp_path):
    res = run_limited(tmp_path, *train_args(tmp_path, "--threads", "5000"))
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    line = one_line(res.stderr, "moonrt train: error: threads (--threads) = 5000: expected an integer in [0, 1024]")
    assert "0 = torch default" in line
    assert not (tmp_path / "out").exists()


def test_batch_size_beyond_physical_memory_refused_before_allocating(tmp_path):
    res = run_limited(tmp_path, *train_args(tmp_path, "--batch-size", "1000000000"))
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    line = one_line(res.stderr, "moonrt train: error: optim.batch_size (--batch-size) = 1000000000: expected "
                                "batch_size x (seq_len + 1) x 8 bytes")
    assert f"= {10**9 * 17 * 8} bytes) <= this host's physical memory (" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (("--lr", "inf"), "optim.lr (--lr) = inf: expected a finite number"),
    (("--lr", "nan"), "optim.lr (--lr) = nan: expected a finite number"),
    (("--lr", "-1"), "optim.lr (--lr) = -1.0: expected a finite number > 0"),
    (("--seed", "-1"), "optim.seed (--seed) = -1: expected an integer in [0, 9223372036854775807]"),
    (("--seed", str(2**70)), f"optim.seed (--seed) = {2**70}: expected an integer in [0, 9223372036854775807]"),
    (("--steps", str(2**63)), f"optim.steps (--steps) = {2**63}: expected an integer <= 9223372036854775807"),
])
def test_numeric_flags_refused_naming_the_field(tmp_path, capsys, flags, message):
    assert main(train_args(tmp_path, *flags)) == 2
    one_line(capsys.readouterr().err, f"moonrt train: error: {message}")
    assert not (tmp_path / "out").exists()


# ---- 3. mem-plan plans in the model's training dtype -------------------------------------------------------------

def test_mem_plan_k3_defaults_plan_in_bf16_on_any_machine(capsys):
    """K3 trains in bf16: with the default flags, 80 GiB needs 121.4 GiB and 141 GiB fits (the README's figures),
    not the planning machine's dtype (fp32 on a CPU: 188.3 GiB)."""
    assert main(["mem-plan"]) == 1  # 80 GiB does not fit
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("== ")]
    assert len(headers) == 2 and all(h.startswith("== k3 bf16 (training dtype): ") for h in headers), headers
    assert "does not fit 80 GiB: minimum budget 121.4 GiB" in out and "fits 141 GiB" in out
    assert main(["mem-plan", "--dtype", "fp32", "--budget-gib", "141"]) == 1
    assert "== k3 fp32 (--dtype): " in capsys.readouterr().out


def test_mem_plan_k3_tiny_defaults_to_fp32(capsys):
    assert main(["mem-plan", "--model", "k3_tiny", "--pp", "2", "--ep", "1", "--cp", "1", "--vpp", "1", "--schedule",
                 "1f1b", "--seq-len", "4096", "--microbatches", "8", "--budget-gib", "1"]) == 0
    assert "== k3_tiny fp32 (training dtype): " in capsys.readouterr().out


# ---- 4. a text corpus is memory-mapped, not read whole -----------------------------------------------------------

def test_text_corpus_same_tokens_and_split_as_reading_it_whole(tmp_path, monkeypatch):
    import numpy as np

    from moonrt.jobs.train import data

    path = tmp_path / "c.txt"
    path.write_text("".join(f"doc {i}: {'é' * (i % 5)} text\n" for i in range(500)))
    whole = np.fromfile(path, dtype=np.uint8)  # the old reading
    cut = len(whole) - max(1, int(len(whole) * 0.05))
    monkeypatch.setattr(data, "CHUNK_TOKENS", 7)  # many chunks in the whole-corpus passes
    c = data.load_corpus(str(path), None, 256, 0.05, eos_id=ord("\n"))
    assert isinstance(c.train, np.memmap) and isinstance(c.heldout, np.memmap)
    assert np.array_equal(c.train, whole[:cut]) and np.array_equal(c.heldout, whole[cut:])
    for split, docs in ((whole[:cut], c.train_docs), (whole[cut:], c.heldout_docs)):
        ends = np.flatnonzero(split == ord("\n")) + 1
        assert np.array_equal(docs, np.concatenate([[0], ends[ends < len(split)]]))
    counts = np.bincount(whole[cut:], minlength=256)
    p = counts[counts > 0] / counts.sum()
    assert data.unigram_entropy(c.heldout, 256) == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    assert np.array_equal(data.global_batch(c.train, 3, 5, 4, 16),
                          data.global_batch(whole[:cut], 3, 5, 4, 16))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert len(data.text_corpus(empty).train) == 0  # refused later by the length check, as before


MAPPED = textwrap.dedent("""
    import resource, sys
    from moonrt.jobs.train import data
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    # private memory (heap, anonymous maps) limited to what the process holds plus 128 MiB: the corpus below is
    # 384 MiB, so reading it whole fails; a read-only file mapping does not count against RLIMIT_DATA
    resource.setrlimit(resource.RLIMIT_DATA, (used + (128 << 20),) * 2)
    c = data.load_corpus(sys.argv[1], None, 256, 0.05, eos_id=10)
    batch = data.global_batch(c.train, 0, 0, 8, 128)
    data.eval_windows(c.heldout, 32, 128)
    print(len(c.train) + len(c.heldout), batch.shape, data.unigram_entropy(c.heldout, 256))
""")


def test_text_corpus_larger_than_allowed_memory_loads(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 384 MiB of zero bytes that take no disk
        f.truncate(384 << 20)
    res = subprocess.run([sys.executable, "-c", MAPPED, str(big)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[:3] == [str(384 << 20), "(8,", "129)"]


# ---- 5. outputs of mem-plan, pp-plan, ep-sim created exclusively --------------------------------------------------

MEM_PLAN = ["mem-plan", "--model", "k3_tiny", "--pp", "2", "--ep", "1", "--cp", "1", "--vpp", "1", "--schedule",
            "1f1b", "--seq-len", "4096", "--microbatches", "8", "--budget-gib", "1"]
PP_PLAN = ["pp-plan", "--model", "k3_tiny", "--pp", "2", "--microbatches", "4"]
EP_SIM = ["ep-sim", "--experts", "32", "--ranks", "4", "--top-k", "4", "--tokens", "64", "--steps", "4", "--layers",
          "2", "--quiet"]


def _commands(tmp_path: Path) -> dict[str, tuple[list[str], list[Path]]]:
    """command -> (argv writing into tmp_path/out, the files it writes there)."""
    out = tmp_path / "out"
    mp = out / "budget1"
    return {
        "mem-plan": ([*MEM_PLAN, "--out", str(out)],
                     [mp / "plan.json", mp / "plan.png", mp / "policy_rank0.yaml", mp / "policy_rank1.yaml"]),
        "pp-plan": ([*PP_PLAN, "--out", str(out), "--json", str(tmp_path / "plan.json")],
                    [out / "plan.json", out / "timeline.png", tmp_path / "plan.json"]),
        "ep-sim": ([*EP_SIM, "--out", str(out)], [out / "summary.json", out / "ep_sim.png"]),
    }


@pytest.mark.parametrize("command", ["mem-plan", "pp-plan", "ep-sim"])
def test_outputs_refuse_existing_files_and_symlinks_unless_force(tmp_path, capsys, command):
    argv, files = _commands(tmp_path)[command]
    assert main(argv) == 0
    capsys.readouterr()
    assert all(f.read_bytes() for f in files)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for target in files:
        for f in files:
            f.unlink(missing_ok=True)
        # an existing file: refused before any work, one line naming it, nothing else written
        target.write_text("mine\n")
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert str(target) in err and "--force" in err and len(err.strip().splitlines()) == 1, err
        assert target.read_text() == "mine\n" and not any(f.exists() for f in files if f != target)
        # a symlink planted there: refused the same way, its target never written
        target.unlink()
        target.symlink_to(victim)
        assert main(argv) == 2
        assert str(target) in capsys.readouterr().err and victim.read_text() == "precious\n"
        target.unlink()
    assert main(argv) == 0
    # --force replaces files whole and a symlink itself, never writing through it
    files[0].unlink()
    files[0].symlink_to(victim)
    files[-1].write_text("stale\n")
    assert main([*argv, "--force"]) == 0
    assert victim.read_text() == "precious\n"
    assert not files[0].is_symlink() and files[0].read_bytes()[:1] in (b"{", b"\x89")
    assert files[-1].read_bytes() != b"stale\n"
    assert sorted(p.name for p in files[0].parent.iterdir() if p.name.endswith(".tmp")) == []  # no temp file left


def test_ep_sim_negative_seed_names_the_flag(tmp_path, capsys):
    assert main([*EP_SIM, "--seed", "-1", "--out", str(tmp_path / "out")]) == 2
    assert one_line(capsys.readouterr().err, "moonrt ep-sim: --seed: -1, expected an integer >= 0")


@pytest.mark.parametrize("argv", [
    ["pp-plan", "--pp", "8", "--microbatches", "100000000"],
    ["pp-plan", "--num-layers", "100000000", "--pp", "50000000"],
    ["mem-plan", "--pp", "16", "--microbatches", "1048576"],
])
def test_planner_schedule_size_bounded(tmp_path, capsys, argv):
    """A schedule of 10**8 micro-batches was simulated action by action (minutes, gigabytes): refused up front."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ("MAX_SCHEDULE_CELLS" in err or "MAX_LAYERS" in err), err
