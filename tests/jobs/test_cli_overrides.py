"""``--set section.key=value`` (moonrt train, sbatch, mem-plan), ``mem-plan --config JOB.yaml``, the grouped
torch-free ``moonrt train --help`` and the extra ``moonrt sbatch`` directives: values typed by the job schema,
the precedence default < --config < --set < flags (a flag contradicting a --set refused), one-line errors naming
the field, the run's config.yaml recording the overridden value."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster.helpers import clean_env
from jobs.helpers import _cli

from moonrt.cli import _stop_signal_arg
from moonrt.cli import main as cli_main
from moonrt.cluster.sbatch import SbatchJob, render_sbatch
from moonrt.config import ConfigError
from moonrt.jobs.train import cli as train_cli
from moonrt.jobs.train.overrides import job_config, parse_set

ROOT = Path(__file__).resolve().parents[2]


def _job(*argv: str):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.job_from_args(parser.parse_args(list(argv)))


def test_set_values_are_typed_by_the_schema(tmp_path: Path) -> None:
    job = _job("--set", "optim.lr=1e-3", "--set", "parallel.ep=2", "--set", "data.pack_documents=true",
               "--set", "dist.timeout_s=30", "--set", "optim.seed=7")
    assert job.optim.lr == 1e-3 and isinstance(job.optim.lr, float)  # YAML 1.1 reads 1e-3 as a string
    assert job.parallel.ep == 2 and job.data.pack_documents is True and job.dist.timeout_s == 30.0
    assert job.optim.seed == 7
    assert _job("--set", "data.corpus=1e-3").data.corpus == "1e-3"  # a string field keeps the text
    assert _job("--set", "optim.muon_adamw_modules=[lm_head, embed]").optim.muon_adamw_modules == ["lm_head", "embed"]
    assert _job("--set", "dist.timeout_s=null").dist.timeout_s is None
    assert _job("--set", "dist.timeout_s=").dist.timeout_s is None  # an empty YAML value is null
    assert _job("--set", "optim.lr=1", "--set", "optim.lr=0.5").optim.lr == 0.5  # the later --set of a key wins
    assert _job("--set", "moe.qb_bins=3").moe == {"qb_bins": 3}
    assert _job("--set", "device=cpu").device == "cpu"


def test_model_config_fields_start_from_the_preset() -> None:
    from moonrt.models import presets

    job = _job("--set", "model_config.hidden_size=128")
    ref = presets()["k3_tiny"].presets["k3_tiny"]()
    cfg = job.model_cfg()
    assert cfg.hidden_size == 128 and cfg.num_hidden_layers == ref.num_hidden_layers
    dense = _job("--set", "model=dense_tiny", "--set", "model_config.hidden_size=64").model_cfg()
    assert type(dense).__name__ == "DenseConfig" and dense.hidden_size == 64
    assert _job("--model", "dense_tiny", "--set", "model_config.hidden_size=64").model_cfg().hidden_size == 64


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "optim.stepz=3"], "optim.stepz (--set): unknown key in OptimConfig; expected one of batch_size, "),
    (["--set", "optimx.lr=1"],
     "optimx (--set): unknown key in JobConfig; expected one of checkpoint, data, deterministic, device, dist, "),
    (["--set", "model_config.hidden_sizee=3"], "model_config.hidden_sizee (--set): unknown key in K3Config; "),
    (["--set", "optim.lr.x=1"], "optim.lr.x (--set): optim.lr is a field, not a section of fields"),
    (["--set", "optim.lr=abc"], "optim.lr (--set) = 'abc': expected a number"),
    (["--set", "parallel.ep=two"], "parallel.ep (--set) = 'two': expected an integer"),
    (["--set", "data.pack_documents=maybe"], "data.pack_documents (--set) = 'maybe': expected true or false"),
    (["--set", "parallel.schedule=foo"], "parallel.schedule (--set) = 'foo': expected one of 'auto', "),
    (["--set", "dist.timeout_s=-1"], "dist.timeout_s (--set) = -1.0: expected a positive number of seconds"),
    (["--set", "optim.muon_adamw_modules=lm_head"], "optim.muon_adamw_modules (--set) = 'lm_head': expected a list"),
    (["--set", "moe.qb_bins=0"], "moe.qb_bins (--set) = 0: expected an integer >= 1"),
    (["--set", "lr"], "--set 'lr': expected KEY=VALUE with KEY a dotted field path"),
    (["--set", "optim.lr=[1"], "--set optim.lr value line 1, column 3: malformed YAML"),
    (["--set", "optim.lr=1", "--lr", "2"], "optim.lr: --lr 2.0 and --set optim.lr=1 disagree; expected one value"),
    (["--lr", "inf"], "optim.lr (--lr) = inf: expected a finite number"),
])
def test_bad_set_names_the_field(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _job(*argv)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("optim:\n  lr: 0.01\n  steps: 9\nparallel:\n  ep: 2\n")
    assert _job("--config", str(cfg)).optim.lr == 0.01  # --config over the embedded default
    job = _job("--config", str(cfg), "--set", "optim.lr=0.02", "--set", "parallel.ep=4", "--ep", "4")
    assert job.optim.lr == 0.02 and job.optim.steps == 9 and job.parallel.ep == 4  # --set over --config
    assert _job("--config", str(cfg), "--set", "optim.lr=0.02", "--steps", "3").optim.steps == 3  # flag over both
    assert _job("--set", "optim.lr=2", "--lr", "2").optim.lr == 2.0  # agreeing spellings are fine
    with pytest.raises(ConfigError, match="parallel.ep: --ep 8 and --set parallel.ep=4 disagree"):
        _job("--config", str(cfg), "--set", "parallel.ep=4", "--ep", "8")
    with pytest.raises(ConfigError, match="data.pack_documents: --pack-documents True and --set "):
        _job("--set", "data.pack_documents=false", "--pack-documents")
    bad = tmp_path / "bad.yaml"  # the file must be valid on its own, named in its messages
    bad.write_text("optim:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: optim.lr = -1.0"):
        job_config(bad, ["optim.lr=1"])


def test_parse_set() -> None:
    o = parse_set("parallel.ep=4")
    assert o.path == ("parallel", "ep") and o.value == 4 and o.field == "parallel.ep"
    assert parse_set("x.y=a=b").value == "a=b"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_set("1x=3")


def test_stop_signal_from_set_arms_early() -> None:
    assert _stop_signal_arg(["--set", "stop_signal=USR1"]) == "USR1"
    assert _stop_signal_arg(["--set=stop_signal='USR2'"]) == "USR2"
    assert _stop_signal_arg(["--set", "stop_signal=USR1", "--signal", "USR2"]) == "USR2"


def test_run_config_records_the_overridden_value(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 500)
    out = tmp_path / "o"
    rc = cli_main(["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--corpus", str(corpus),
                   "--out", str(out), "--no-progress", "--set", "optim.lr=1e-3", "--set", "optim.warmup_steps=1",
                   "--set", "optim.eval_every=1", "--set", "optim.eval_windows=2"])
    assert rc == 0, capsys.readouterr().err
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["optim"]["lr"] == 1e-3 and recorded["optim"]["warmup_steps"] == 1


def test_train_cli_bad_set_is_one_line_exit_2(capsys) -> None:
    assert cli_main(["train", "--set", "optim.stepz=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moonrt train: error: optim.stepz (--set): unknown key in OptimConfig") and "\n" not in err


def test_help_is_grouped_and_imports_no_torch() -> None:
    code = ("import argparse, sys\n"
            "from moonrt.jobs.train import cli\n"
            "p = argparse.ArgumentParser(prog='moonrt train')\n"
            "cli.add_arguments(p)\n"
            "text = p.format_help()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
            "ungrouped = [a.dest for a in p._optionals._group_actions if a.dest != 'help']\n"
            "assert not ungrouped, ungrouped\n"
            "print(text)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for title in ("job config", "job (JobConfig's top-level fields)", "data (DataConfig)", "optim (OptimConfig)",
                  "parallel (ParallelConfig)", "log (LogConfig)", "checkpoint (CheckpointConfig)",
                  "dist (DistConfig)", "precision (PrecisionConfig)", "kernels (KernelsConfig)", "run control"):
        assert f"\n{title}:" in r.stdout, title
    r = subprocess.run([sys.executable, "-c", "import sys\nfrom moonrt.cli import main\n"
                        "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
                        "assert 'torch' not in sys.modules\n"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "--set KEY=VALUE" in r.stdout, r.stderr


@pytest.mark.parametrize("env, flags, message", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "1"}, ["--pp", "2", "--ep", "3", "--microbatches", "2"],
     "parallel = pp 2 x ep 3 x cp 1 = 6 ranks per data-parallel replica: expected a divisor of the world size 8"),
    ({}, ["--cp", "4", "--seq-len", "3"], "parallel.cp (--cp) = 4: expected at most optim.seq_len (--seq-len) = 3"),
])
def test_degrees_that_cannot_fit_are_refused_before_torch_is_imported(env: dict, flags: list[str],
                                                                     message: str) -> None:
    """A rank of a job whose degrees do not fit its launcher's world (or its sequence) says so in one line, exit 2,
    before importing torch or joining the others (an 8-rank job of such ranks: every rank refuses in ~0.1 s, none
    waits at the rendezvous: ``MASTER_PORT`` 1 is never dialled)."""
    code = ("import sys\nfrom moonrt.cli import main\n"
            f"rc = main(['train', '--steps', '1', '--no-progress', *{flags!r}])\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
            "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**clean_env(), **env})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"moonrt train: error: {message}") and r.stderr.count("\n") == 1, r.stderr


# ------------------------------------------------------------------------------------------------
# moonrt sbatch


def test_sbatch_set_is_checked_and_passed(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("parallel:\n  ep: 2\n")
    rc = cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "4", "--config", str(cfg), "--set",
                   "parallel.ep=4", "--set", "dist.timeout_s=45", "--", "prog"])
    text = capsys.readouterr().out
    assert rc == 0
    assert text.splitlines()[-1].endswith(f"prog --config {cfg} --set parallel.ep=4 --set dist.timeout_s=45")
    assert "export MOONRT_DIST_TIMEOUT=45" in text.splitlines()  # the overridden dist section is the job's
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "4", "--config", str(cfg), "--set",
                     "parallel.ep=8", "--", "prog"]) == 2
    assert "parallel = dp 1 x pp 1 x ep 8 x cp 1 = 8: expected nodes 1 x ntasks_per_node 4" in capsys.readouterr().err
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--config", str(cfg), "--set",
                     "parallel.epp=2", "--", "prog"]) == 2
    assert "parallel.epp (--set): unknown key in ParallelConfig" in capsys.readouterr().err
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--set", "parallel.ep=2", "--", "prog"]) == 2
    assert "--set parallel.ep=2: expected together with --config" in capsys.readouterr().err
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "2", "--config", str(cfg), "--requeue", "--set",
                     "stop_signal=USR2", "--", "prog"]) == 2
    assert "--set stop_signal=USR2: expected stop_signal USR1 with --requeue" in capsys.readouterr().err


def test_sbatch_directives_render() -> None:
    job = SbatchJob(command=["prog"], gpus_per_node=8, account="proj-1", qos="high", mem="64G",
                    sbatch_lines=["#SBATCH --exclusive", "#SBATCH --constraint=h100", "#SBATCH --gres gpu:8"],
                    requeue=True)
    lines = render_sbatch(job).splitlines()
    for line in ("#SBATCH --gpus-per-node=8", "#SBATCH --account=proj-1", "#SBATCH --qos=high", "#SBATCH --mem=64G",
                 "#SBATCH --exclusive", "#SBATCH --constraint=h100", "#SBATCH --gres gpu:8"):
        assert line in lines
    directives = [i for i, x in enumerate(lines) if x.startswith("#SBATCH")]
    assert directives == list(range(1, len(directives) + 1))  # all before the first command: sbatch reads them
    for mem in ("500M", "0", "1T", "2048"):
        assert f"#SBATCH --mem={mem}" in render_sbatch(SbatchJob(command=["p"], mem=mem)).splitlines()
    assert not any(x.startswith(("#SBATCH --mem", "#SBATCH --qos", "#SBATCH --account", "#SBATCH --gpus"))
                   for x in render_sbatch(SbatchJob(command=["p"])).splitlines())


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--gpus-per-node", "0", "--gpus-per-node = 0: expected an integer in [1, 1024]"),
    ("--gpus-per-node", "5000", "--gpus-per-node = 5000: expected an integer in [1, 1024]"),
    ("--account", "a;b", "--account = 'a;b': expected a SLURM name"),
    ("--qos", "hi gh", "--qos = 'hi gh': expected a SLURM name"),
    ("--mem", "64X", "--mem = '64X': expected a SLURM memory size"),
    ("--mem", "-1G", "--mem = '-1G': expected a SLURM memory size"),
    ("--mem", "64G\nid", "--mem = '64G\\nid': expected a SLURM memory size"),
    ("--sbatch-line", "#SBATCH --x=$(id)", "--sbatch-line = '#SBATCH --x=$(id)': expected '#SBATCH --option'"),
    ("--sbatch-line", "#SBATCH --x=1\n#SBATCH --y", "--sbatch-line = '#SBATCH --x=1\\n#SBATCH --y': expected"),
    ("--sbatch-line", "#SBATCH --x a b", "--sbatch-line = '#SBATCH --x a b': expected"),
    ("--sbatch-line", "#SBATCH --x='a'", "--sbatch-line = \"#SBATCH --x='a'\": expected"),
    ("--sbatch-line", "echo hi", "--sbatch-line = 'echo hi': expected"),
    ("--sbatch-line", "#SBATCH -N 2", "--sbatch-line = '#SBATCH -N 2': expected"),
    ("--sbatch-line", "#SBATCH --nodes=3", "expected an option the script does not write itself (moonrt sbatch "
     "--nodes sets it)"),
    ("--sbatch-line", "#SBATCH --output=x", "(moonrt sbatch --log sets it)"),
    ("--sbatch-line", "#SBATCH --ntasks=3", "(moonrt sbatch --nodes x --ntasks-per-node sets it)"),
])
def test_sbatch_bad_directive_is_refused_naming_the_flag(flag: str, value: str, message: str, capsys) -> None:
    assert cli_main(["sbatch", "--nodes", "1", "--ntasks-per-node", "1", f"{flag}={value}", "--", "prog"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"moonrt sbatch: {flag} = "), err
    assert len(err.strip().splitlines()) == 1


def test_sbatch_script_with_directives_parses() -> None:
    text = render_sbatch(SbatchJob(command=["prog", "a b"], gpus_per_node=4, account="acct", qos="normal", mem="0",
                                   sbatch_lines=["#SBATCH --exclusive"]))
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------
# moonrt mem-plan --config


def _mem_plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moonrt.cli", "mem-plan", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def _plan(path: Path) -> dict:
    plan = json.loads((path / "budget1" / "plan.json").read_text())
    plan.pop("solve_s", None)  # wall time of the solver
    return plan


@pytest.mark.slow
def test_mem_plan_config_equals_the_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("parallel: {pp: 2, ep: 2}\n")
    common = ["--budget-gib", "1", "--solver", "greedy"]
    a = _mem_plan("--config", str(cfg), *common, "--out", str(tmp_path / "a"))
    assert a.returncode in (0, 1), a.stderr
    # the job's defaults: k3_tiny, seq_len 128, batch_size 8 over dp 1 x ep 2 x 1 micro-batch = 4 rows, adamw
    b = _mem_plan("--model", "k3_tiny", "--dp", "1", "--pp", "2", "--vpp", "1", "--ep", "2", "--cp", "1",
                  "--microbatches", "1", "--schedule", "1f1b", "--seq-len", "128", "--micro-batch-size", "4",
                  "--optimizer", "adamw", *common, "--out", str(tmp_path / "b"))
    assert b.returncode == a.returncode, b.stderr
    assert _plan(tmp_path / "a") == _plan(tmp_path / "b")
    assert a.stdout.splitlines()[0] == b.stdout.splitlines()[0]
    # an explicit flag wins over the job; --set applies as in moonrt train
    c = _mem_plan("--config", str(cfg), "--set", "optim.seq_len=256", "--ep", "1", *common)
    assert "pp=2 vpp=1 ep=1 cp=1 seq=256 mbs=8 m=1 1f1b" in c.stdout, c.stderr


@pytest.mark.parametrize(("text", "extra", "message"), [
    ("model: dense_tiny\n", [], "mem-plan: model (JOB) = 'dense_tiny': model family 'dense' has no memory "
     "description"),
    ("parallel: {pp: 2, schedule: zb, microbatches: 2}\n", [], "parallel.schedule = 'zb' (JOB): expected 1f1b, "
     "interleaved or gpipe"),
    ("parallel: {ep: 2}\noptim: {batch_size: 3}\n", [], "optim.batch_size = 3 (JOB): expected a multiple of "
     "dp x ep x microbatches = 2"),
    ("optim: {stepz: 1}\n", [], "JOB: optim.stepz: unknown key in OptimConfig"),
    ("{}\n", ["--set", "parallel.epp=2"], "parallel.epp (--set): unknown key in ParallelConfig"),
])
def test_mem_plan_bad_job_is_one_line(tmp_path: Path, text: str, extra: list[str], message: str, capfd) -> None:
    """Refused before any planning: in this process (``_cli``), not a new interpreter's imports."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    code, _, err = _cli(["mem-plan", "--config", str(cfg), *extra], capfd)
    assert code == 2 and message.replace("JOB", str(cfg)) in err, err
    assert len(err.strip().splitlines()) == 1
