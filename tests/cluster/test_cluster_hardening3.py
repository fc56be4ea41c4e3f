"""Issue 45, cluster part: ranks under torchrun die with its agent; jobs without a launcher identity kept apart;
`moonrt sbatch` sizes bounded and `--sbatch-line` compared after SLURM's own option abbreviation rules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cluster.helpers import _gone, _wait_for, clean_env

from moonrt.cli import main as cli_main
from moonrt.cluster.network import free_port

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


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


# ---------------------------------------------------------------------------------------------
# 2. Jobs without a launcher identity (plain RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) kept apart

PLAIN_JOIN = textwrap.dedent("""
    import json, os, sys, time
    here = sys.argv[1]
    import torch.distributed as dist
    from moonrt.cluster.env import init_distributed
    tag = os.environ["JOB_TAG"] + "-" + os.environ["RANK"]
    try:
        init_distributed()
    except ValueError as exc:
        print(f"moonrt test: {exc}", file=sys.stderr)
        sys.exit(2)
    open(os.path.join(here, "joined-" + tag), "w").close()
    while not os.path.exists(os.path.join(here, "release")):
        time.sleep(0.1)
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, os.environ["JOB_TAG"])
    print("GROUP " + json.dumps(ids), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def _plain_rank(prog: Path, here: Path, job: str, rank: int, port: int) -> subprocess.Popen:
    """A rank started as a hand-written script starts it: only RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    env = {k: v for k, v in clean_env().items() if k != "MOONRT_JOB_ID" and not k.startswith("TORCHELASTIC_")}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), JOB_TAG=job,
               MOONRT_DIST_TIMEOUT="60", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(prog), str(here)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_job_without_identity_on_one_port_is_refused_naming_the_clash(tmp_path):
    """Job A (2 ranks, plain variables) has formed its group; job B, started the same way on the same port, used
    to join A's store (two unnamed jobs compared equal): B's rank 1 took A's rank slot. Now each of B's ranks fails
    in one line naming the clash, and A runs on, unaffected."""
    prog = tmp_path / "join.py"
    prog.write_text(PLAIN_JOIN)
    port = free_port()
    procs = {f"A-{r}": _plain_rank(prog, tmp_path, "A", r, port) for r in range(2)}
    try:
        _wait_for(lambda: all((tmp_path / f"joined-{t}").exists() or p.poll() is not None for t, p in procs.items()),
                  what="job A's group formed")
        assert all(p.poll() is None for p in procs.values()), {t: p.communicate() for t, p in procs.items()}
        for r in range(2):
            procs[f"B-{r}"] = _plain_rank(prog, tmp_path, "B", r, port)
        for r in range(2):
            p = procs[f"B-{r}"]
            try:
                _, err = p.communicate(timeout=50)
            except subprocess.TimeoutExpired:
                pytest.fail(f"job B's rank {r} still running 50 s after it started (joined job A's store?)")
            lines = [ln for ln in err.splitlines() if f"another job is using MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}"
                     in ln]
            assert p.returncode == 2 and len(lines) == 1, f"B-{r}: exit {p.returncode}\n{err[-3000:]}"
            assert not (tmp_path / f"joined-B-{r}").exists()
        (tmp_path / "release").touch()
        for r in range(2):
            out, err = procs[f"A-{r}"].communicate(timeout=60)
            assert procs[f"A-{r}"].returncode == 0, err[-3000:]
            assert 'GROUP ["A", "A"]' in out.splitlines(), out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_identity_check_without_a_launcher_identity(tmp_path):
    """In one process, with real stores: rank 0 publishes a nonce; each rank slot is claimed once; a second rank 0,
    or a second process for one rank, is refused naming the clash; named jobs are checked as before (a torchrun
    worker restarted into the agent's store rejoins)."""
    from datetime import timedelta

    import torch.distributed as dist

    from moonrt.cluster.detect import Rendezvous
    from moonrt.cluster.store import check_job_identity, master_store

    store = master_store("127.0.0.1", 0, 2, timedelta(seconds=10))
    port = store.port
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    where = f"another job is using MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}: "

    def rdzv(rank: int) -> Rendezvous:
        return Rendezvous(rank, 2, rank, "127.0.0.1", port, "torchrun")

    check_job_identity(store, rdzv(0), {})
    assert store.get("moonrt/job_identity").decode().startswith("a job without a launcher identity")
    check_job_identity(client, rdzv(1), {})  # the job's own rank 1 claims its slot
    with pytest.raises(ValueError) as exc:  # another job's rank 1 (a fresh claim) on the same port
        check_job_identity(client, rdzv(1), {})
    assert str(exc.value).startswith(where + "rank 1 of the job there (a job without a launcher identity"), exc.value
    assert f"has joined already (pid {os.getpid()} on " in str(exc.value), exc.value
    with pytest.raises(ValueError, match="^" + where + r"its rank 0 \(a job without a launcher identity.*nonce"):
        check_job_identity(client, rdzv(0), {})  # a second rank 0 that reached this store
    with pytest.raises(ValueError, match="belongs to a job without a launcher identity.*but this process .rank 1. "
                                         "belongs to SLURM job 7 step 0"):
        check_job_identity(client, rdzv(1), {"SLURM_JOB_ID": "7"})
    with pytest.raises(ValueError, match=where + ".*Address already in use"):
        master_store("127.0.0.1", port, 2, timedelta(seconds=10), connect="127.0.0.1")  # a second rank 0's bind

    agent = master_store("127.0.0.1", 0, 2, timedelta(seconds=10))
    named = {"TORCHELASTIC_RUN_ID": "r1"}
    other = Rendezvous(1, 2, 1, "127.0.0.1", agent.port, "torchrun")
    check_job_identity(agent, Rendezvous(0, 2, 0, "127.0.0.1", agent.port, "torchrun"), named)
    check_job_identity(agent, other, named)
    check_job_identity(agent, other, named)  # a restarted worker of the same run: no slot to claim
    with pytest.raises(ValueError, match="belongs to torchrun run r1, but this process .rank 1. belongs to a job "
                                         "without a launcher identity"):
        check_job_identity(agent, other, {})


# ---------------------------------------------------------------------------------------------
# 1. Ranks die with torchrun's agent


def _children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] not in "ZX":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun beside {sys.executable}")
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find torchrun's workers")
def test_ranks_die_with_a_killed_torchrun(tmp_path):
    """``kill -9`` of torchrun used to leave both ranks of a ``moonrt train`` training on, unsupervised, holding the
    ``--out`` lock. Now each rank dies with its agent (the parent-death signal, or the watchdog), and the lock is
    free for the next run."""
    from moonrt.config import ConfigError
    from moonrt.jobs.train.outputs import lock_out_dir

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    out, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    env = {k: v for k, v in clean_env().items() if k != "MOONRT_JOB_ID" and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    agent = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--no-python", sys.executable,
                              "-m", "moonrt.cli", "train", "--steps", "100000", "--corpus", str(corpus),
                              "--batch-size", "2", "--seq-len", "16", "--no-progress", "--out", str(out),
                              "--metrics", str(metrics)],
                             cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    ranks: list[int] = []
    try:
        _wait_for(lambda: (metrics.exists() and metrics.read_text().count("\n") >= 1) or agent.poll() is not None,
                  240, "the first metrics line of the torchrun job")
        assert agent.poll() is None, agent.communicate()[1][-4000:]
        ranks = _children(agent.pid)
        assert len(ranks) == 2, ranks
        agent.kill()  # SIGKILL: torchrun cannot stop its workers
        agent.wait(timeout=30)
        _wait_for(lambda: all(_gone(pid) for pid in ranks), 20, "both ranks gone within 20 s of torchrun's kill -9")

        def lock_free() -> bool:  # a new run can take --out
            try:
                with lock_out_dir(out, create=False):
                    return True
            except ConfigError:
                return False

        # a killed rank's main thread shows as a zombie while its other threads are still exiting and the shared
        # file table (the lock's descriptor) is not yet released: on a loaded machine that takes a moment
        _wait_for(lock_free, 20, "--out's lock free within 20 s of the ranks' exit")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for pid in ranks:
            try:
                os.killpg(pid, signal.SIGKILL)  # torchrun starts each worker in a session of its own
            except (ProcessLookupError, PermissionError):
                pass


AGENT_CHILD = textwrap.dedent("""
    import os, sys, time
    from moonrt.cluster import lifeline
    if sys.argv[1] == "watchdog":  # no prctl (macOS, BSD): the thread watches the agent instead
        lifeline.libc_prctl = lambda: None
    lifeline.watch_launcher(poll_s=0.1)
    print(os.getpid(), lifeline.parent_death_signal(), flush=True)
    while True:
        time.sleep(0.2)
""")
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    env = {k: v for k, v in os.environ.items() if k != "MOONRT_LAUNCHER_PID"}
    env["TORCHELASTIC_RUN_ID"] = "test-run"  # what torchrun's agent gives each worker, which it starts like this
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    print(child.stdout.readline().strip(), flush=True)
    time.sleep(3600)
""")


@pytest.mark.parametrize(("how", "pdeathsig"), [("prctl", int(signal.SIGKILL)), ("watchdog", 0)])
def test_torchrun_worker_dies_with_its_agent(how, pdeathsig):
    """A stand-in agent (no torch) starts a worker as torchrun does; kill -9 of the agent ends the worker, through the
    parent-death signal the worker set itself, or, without prctl, through the watchdog thread."""
    env = {k: v for k, v in clean_env().items() if not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    agent = subprocess.Popen([sys.executable, "-c", AGENT, AGENT_CHILD, how], env=env, stdout=subprocess.PIPE,
                             text=True)
    pid = None
    try:
        pid_s, sig = agent.stdout.readline().split()
        pid = int(pid_s)
        assert int(sig) == pdeathsig
        assert not _gone(pid)
        agent.kill()
        agent.wait(timeout=30)
        _wait_for(lambda: _gone(pid), 20, "the worker gone after its agent's kill -9")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_only_torchrun_workers_bind_to_their_parent():
    from moonrt.cluster.lifeline import die_with_agent

    assert die_with_agent({}) is None
    assert die_with_agent({"TORCHELASTIC_RUN_ID": "r", "MOONRT_LAUNCHER_PID": "1234"}) is None  # moonrt launch's rank
