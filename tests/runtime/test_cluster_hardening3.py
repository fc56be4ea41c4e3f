"""Issue 45, cluster part: `moonrt sbatch` sizes bounded and `--sbatch-line` compared after SLURM's own option
abbreviation rules; jobs without a launcher identity kept apart; ranks under torchrun die with its agent."""

from __future__ import annotations

from pathlib import Path

import pytest

from moonrt.cli import main as cli_main

# ---------------------------------------------------------------------------------------------
# 3. sbatch: rank count bound, options sbatch reads as one the script writes


def _sbatch(tmp_path: Path, *argv: str, nodes: str = "1", tasks: str = "2") -> list[str]:
    return ["sbatch", "--nodes", nodes, "--ntasks-per-node", tasks, "--output", str(tmp_path / "job.sbatch"), *argv,
            "--", "true"]


@pytest.mark.parametrize(("nodes", "tasks"), [("100000000", "100000000"), ("257", "256"), ("1", "65537")])
def test_sbatch_refuses_more_ranks_than_the_bound(nodes, tasks, tmp_path, capsys):
    assert cli_main(_sbatch(tmp_path, nodes=nodes, tasks=tasks)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moonrt sbatch: --nodes x --ntasks-per-node = {nodes} x {tasks} = {int(nodes) * int(tasks)} "
                   "ranks: expected at most 65536 (MAX_RANKS)"], err
    assert not (tmp_path / "job.sbatch").exists()


def test_sbatch_accepts_ranks_up_to_the_bound(tmp_path, capsys):
    assert cli_main(_sbatch(tmp_path, nodes="256", tasks="256")) == 0, capsys.readouterr().err
    assert "#SBATCH --nodes=256" in (tmp_path / "job.sbatch").read_text().splitlines()


@pytest.mark.parametrize(("line", "flag", "reads_as"), [
    ("#SBATCH --sig=B:USR1@5", "--requeue", "--signal"),
    ("#SBATCH --tasks-per-node=4", "--ntasks-per-node", "--ntasks-per-node"),  # sbatch's alias
    ("#SBATCH --tasks=4", "--ntasks-per-node", "--ntasks-per-node"),  # abbreviates the alias
    ("#SBATCH --node=3", "--nodes", "--nodes"),
    ("#SBATCH --ntasks-per-n=2", "--ntasks-per-node", "--ntasks-per-node"),
    ("#SBATCH --out=x.log", "--log", "--output"),
    ("#SBATCH --part=gpu", "--partition", "--partition"),
    ("#SBATCH --tim=10", "--time", "--time"),
    ("#SBATCH --gpus-per-n=8", "--gpus-per-node", "--gpus-per-node"),
    ("#SBATCH --acc=x", "--account", "--account"),
    ("#SBATCH --qo=high", "--qos", "--qos"),
    ("#SBATCH --open=truncate", "--requeue", "--open-mode"),
    ("#SBATCH --req", "--requeue", "--requeue"),
    ("#SBATCH --cpus-per=4", "--cpus-per-task", "--cpus-per-task"),
    ("#SBATCH --job=x", "--job-name", "--job-name"),
    ("#SBATCH --me=1G", "--mem", "--mem"),
])
def test_sbatch_line_refuses_slurm_abbreviations_of_written_options(line, flag, reads_as, tmp_path, capsys):
    """sbatch parses ``#SBATCH`` lines with getopt_long: any unambiguous prefix of a long option (and an alias)
    is that option, so ``--sig=`` would set ``--signal`` a second time."""
    assert cli_main(_sbatch(tmp_path, "--sbatch-line", line)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moonrt sbatch: --sbatch-line = {line!r}: expected an option the "
                                               f"script does not write itself (moonrt sbatch {flag} sets it; sbatch "
                                               f"reads --"), err
    assert f"as {reads_as}" in err[0], err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("line", ["#SBATCH --hold --nodes=4", "#SBATCH --exclusive -N4", "#SBATCH --comment -n8"])
def test_sbatch_line_refuses_an_option_hidden_in_a_spaced_value(line, tmp_path, capsys):
    """A value after a space is a word of its own to sbatch: after an option taking no value (``--hold``) or an
    optional one (``--exclusive``) it is read as an option."""
    assert cli_main(_sbatch(tmp_path, "--sbatch-line", line)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moonrt sbatch: --sbatch-line = {line!r}: expected a value joined "
                                               "with '='"), err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("line", ["#SBATCH -N 4", "#SBATCH -n4", "#SBATCH -t 10", "#SBATCH -o x.log"])
def test_sbatch_line_refuses_short_options(line, tmp_path, capsys):
    assert cli_main(_sbatch(tmp_path, "--sbatch-line", line)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moonrt sbatch: --sbatch-line = {line!r}: expected '#SBATCH "
                                               "--option'"), err


@pytest.mark.parametrize("line", ["#SBATCH --gpus=8", "#SBATCH --exclusive", "#SBATCH --gres=gpu:8",
                                  "#SBATCH --comment=-x", "#SBATCH --constraint h100", "#SBATCH --reservation=r1",
                                  "#SBATCH --mem-per-gpu=8G", "#SBATCH --time-min=10"])
def test_sbatch_line_keeps_sbatchs_other_options(line, tmp_path, capsys):
    """``--gpus`` is an option of its own (an exact name wins over an abbreviation), not ``--gpus-per-node``."""
    assert cli_main(_sbatch(tmp_path, "--sbatch-line", line)) == 0, capsys.readouterr().err
    assert line in (tmp_path / "job.sbatch").read_text().splitlines()
