"""Multi-node jobs on the cluster in a box (``.ci/cluster-box.sh``: two SLURM nodes, each its own network
namespace, address, host name and ``/etc/hosts`` on a private bridge; issue 35).

- A 2-node x 2-rank ``--ep 2 --pp 2`` ``moonrt train`` job (``moonrt sbatch -N 2 --ntasks-per-node 2``), resumed
  from a single-process checkpoint, equals the single process's step within 1e-5 (teacher-forced: the scheme and
  the helpers of ``tests/jobs/test_pp_train.py``); while it runs, ``ss`` inside each node's namespace shows every
  socket the ranks listen on bound to that node's bridge address or to loopback, never a wildcard, and nothing at
  all (SLURM's own daemons included) on an address outside the bridge or loopback.
- ``moonrt launch --nnodes 2`` (one launcher per node, in the node's namespace: ``cluster-box.sh exec``): the
  self-test's collectives and MoonEP across the nodes; a launcher of another job (another ``--rdzv-id``) reaching the
  same master port is refused with a line naming both jobs, and the real job still runs; every process of node2's
  namespace killed mid-step (the node is gone): node1's launcher ends the job within the collective timeout, its
  ranks name node2's ranks, nothing of the job is left on node1; the same for a ``moonrt sbatch`` job, whose node2
  (slurmd included) dies: SLURM declares it dead, ends the step and requeues the job.
- ``mpiexec`` (Hydra) with a host list across the nodes (``.ci/box-ssh`` as its ssh); ``torchrun --nnodes 2`` with
  ``moonrt train``.
- Preemption: ``scancel --signal=USR1 --batch`` on a 2-node ``moonrt sbatch --requeue`` job: saves, the step exits
  75, the job is requeued and resumes on both nodes bit-identically to an uninterrupted run.

The tests skip where the box is not running (with the command that starts it) and fail instead under
``MOONRT_REQUIRE_CLUSTER=1`` (CI, whose ``.ci/run`` starts the box).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from cluster.helpers import clean_env, cluster_unavailable, verify_selftest_report
from jobs.helpers import FLAGS, _assert_same_step, _ckpt, _here, _main_here, _metrics, _run

from moonrt.cluster.preempt import PREEMPTED_EXIT

ROOT = Path(__file__).resolve().parents[2]
BOX_CONF = Path(os.environ.get("MOONRT_BOX_CONF", "/var/spool/moonrt-box/slurm.conf"))
NODES = {"node1": ("mrtbox-n1", "10.213.77.11"), "node2": ("mrtbox-n2", "10.213.77.12")}
"""Node name -> (network namespace, bridge address), as .ci/cluster-box.sh makes them."""
BRIDGE = ipaddress.ip_network("10.213.77.0/24")
START = "start it with `sudo bash .ci/cluster-box.sh start` (.ci/run does)"
JOB_TIMEOUT_S = 240

def box_env() -> dict[str, str]:
    """An environment talking to the box's slurmctld, whose jobs run this checkout's moonrt."""
    env = clean_env()
    env["SLURM_CONF"] = str(BOX_CONF)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="module")
def box() -> dict[str, str]:
    """The box's environment once its nodes answer; else skip (fail under MOONRT_REQUIRE_CLUSTER=1)."""
    for tool in ("sbatch", "sinfo", "scontrol", "ip", "ss"):
        if shutil.which(tool) is None:
            cluster_unavailable(f"{tool!r} not found: the cluster in a box needs SLURM and iproute2; {START}")
    if not (BOX_CONF.parent / "up").exists():
        cluster_unavailable(f"the cluster in a box is not running (no {BOX_CONF.parent / 'up'}): {START}")
    env = box_env()
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        cluster_unavailable(f"the box's slurmctld did not answer sinfo in 30 s: {START}")
    states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
    if res.returncode != 0 or any(states.get(n, "").rstrip("*~#") not in ("idle", "mix", "alloc") for n in NODES):
        cluster_unavailable(f"the cluster in a box has no usable nodes {sorted(NODES)} (sinfo: "
                            f"{res.stdout.strip() or res.stderr.strip()!r}): {START}")
    return env


def listeners(ns: str) -> list[tuple[str, int, str]]:
    """(local address, port, owning process names) of every TCP socket listening in network namespace ``ns``."""
    res = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltnp"], capture_output=True, text=True, timeout=30,
                         check=True)
    out = []
    for line in res.stdout.splitlines():
        fields = line.split()
        local = fields[3]
        addr, port = local.rsplit(":", 1)
        addr = addr.strip("[]").split("%")[0]
        procs = fields[5] if len(fields) > 5 else ""
        out.append((addr, int(port), procs))
    return out


class Watch:
    """Samples :func:`listeners` in every node's namespace until stopped: what listened while a job ran."""

    def __init__(self) -> None:
        self.seen: dict[str, set[tuple[str, int, str]]] = {node: set() for node in NODES}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for node, (ns, _) in NODES.items():
                self.seen[node].update(listeners(ns))
            self._stop.wait(0.3)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def assert_only_on_the_box(seen: dict[str, set[tuple[str, int, str]]]) -> None:
    """Every listening socket is on loopback or the bridge; the ranks' (python) ones on loopback or their own node's
    bridge address exactly (no wildcard: SLURM's daemons bind wildcards, and the namespace has no other network)."""
    for node, socks in seen.items():
        own = NODES[node][1]
        ranks = [s for s in socks if "python" in s[2]]
        assert ranks, f"{node}: no rank was seen listening (the job ended before the first sample?): {socks}"
        for addr, port, procs in socks:
            ip = ipaddress.ip_address(addr)
            ip = getattr(ip, "ipv4_mapped", None) or ip
            where = f"{node}: {addr}:{port} {procs}"
            if "python" in procs:
                assert ip.is_loopback or str(ip) == own, f"a rank listens beyond its node's bridge address: {where}"
            else:
                assert ip.is_loopback or ip.is_unspecified or ip in BRIDGE, where
        # the namespace itself has loopback and the bridge's veth only: a wildcard cannot reach anything else
        res = subprocess.run(["ip", "-n", NODES[node][0], "-o", "addr"], capture_output=True, text=True, timeout=30)
        addrs = {ipaddress.ip_interface(line.split()[3]).ip for line in res.stdout.splitlines()}
        assert all(a.is_loopback or a.is_link_local or a in BRIDGE for a in addrs), (node, addrs)


def sbatch_wait(script: Path, cwd: Path, env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    """Submit ``script`` with ``sbatch --wait``; return its job id and the waiting process."""
    proc = subprocess.Popen(["sbatch", "--parsable", "--wait", str(script)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    job_id = proc.stdout.readline().strip().split(";")[0]
    assert job_id.isdigit(), (job_id, proc.stderr.read() if proc.poll() is not None else "")
    return job_id, proc


def finish(job_id: str, proc: subprocess.Popen, log: Path, env: dict[str, str]) -> int:
    try:
        proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
        proc.wait(timeout=60)
        pytest.fail(f"job {job_id} still running after {JOB_TIMEOUT_S} s:\n{_tail(log)}")
    return proc.returncode


def _tail(log: Path) -> str:
    return log.read_text()[-4000:] if log.exists() else f"(no {log})"


def test_gloo_interface_follows_the_route_to_the_master() -> None:
    """Runs anywhere: loopback for a loopback master, a value already set is kept, an unroutable name sets nothing."""
    from moonrt.cluster.network import interface_of, loopback_interface, route_interface, set_gloo_interface

    lo = loopback_interface()
    assert interface_of("127.0.0.1") == lo and route_interface("127.0.0.1") == lo
    env: dict[str, str] = {}
    assert set_gloo_interface("127.0.0.1", env) == lo and env == {"GLOO_SOCKET_IFNAME": lo}
    env = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert set_gloo_interface("127.0.0.1", env) == "eth7" and env == {"GLOO_SOCKET_IFNAME": "eth7"}
    env = {}
    assert set_gloo_interface("no-such-host.invalid", env) is None and env == {}


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_ep_pp_job_matches_one_process_and_listens_only_on_the_box(box: dict[str, str],
                                                                             tmp_path: Path) -> None:
    _run(tmp_path, {"base": _here("train", *FLAGS, "--until", "1", "--out", "base")})
    for name in ("single", "multi"):
        shutil.copytree(tmp_path / "base", tmp_path / name)
    common = ["train", *FLAGS, "--resume", "--until", "2"]
    _main_here(tmp_path, ("sbatch", "-N", "2", "--ntasks-per-node", "2", "--timeout", "120", "--job-name",
                          "box-ep2-pp2", "--log", "multi.log", "--output", "multi.sbatch", "--",
                          sys.executable, "-m", "moonrt.cli", *common, "--out", "multi", "--metrics", "multi.jsonl",
                          "--ep", "2", "--pp", "2"))
    with Watch() as watch:
        job_id, proc = sbatch_wait(tmp_path / "multi.sbatch", tmp_path, box)
        try:  # the single process's step 2, in this process, while the job runs
            _run(tmp_path, {"single": _here(*common, "--out", "single", "--metrics", "single.jsonl")})
        finally:
            code = finish(job_id, proc, tmp_path / "multi.log", box)
    log = _tail(tmp_path / "multi.log")
    assert code == 0, log
    ref = _metrics(tmp_path / "single.jsonl")[2]
    _assert_same_step(tmp_path, "multi", ref, _ckpt(tmp_path / "single"))
    assert_only_on_the_box(watch.seen)
    # rank = pp_idx * ep + ep_idx: each EP group is the two ranks of one node, so `auto` put MoonEP on that host's
    # shm heap while the pipeline crossed nodes over gloo (the heap is per host; a group spanning hosts resolves to
    # the collectives, tests/comm/test_transport.py)
    recorded = yaml.safe_load((tmp_path / "multi" / "config.yaml").read_text())
    assert recorded["parallel"]["ep_transport"] == "shm", recorded["parallel"]


# ---------------------------------------------------------------------------------------------------------------
# moonrt launch --nnodes 2: one launcher per node, started in the node's namespace (cluster-box.sh exec)

BOX = ["bash", str(ROOT / ".ci" / "cluster-box.sh")]
SELFTEST_SMALL = ["--sizes", "4K", "--iters", "1", "--ep-shapes", "32x16x2x64", "--ep-maxvio", "0,16", "--ep-ffn", "8"]


def on_node(node: str, args: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``moonrt ARGS`` on ``node`` (its namespace, host name and /etc/hosts), output to ``log``."""
    return on_node_argv(node, [sys.executable, "-m", "moonrt.cli", *args], cwd, env, log)


def on_node_argv(node: str, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([*BOX, "exec", node, *argv], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def launch_args(node_rank: int, rdzv_id: str, port: int, timeout: float = 60) -> list[str]:
    return ["launch", "-n", "2", "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "node1",
            "--master-port", str(port), "--rdzv-id", rdzv_id, "--timeout", f"{timeout:g}"]


def wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout: float = JOB_TIMEOUT_S) -> dict:
    codes = {}
    deadline = time.monotonic() + timeout
    try:
        for k, p in procs.items():
            codes[k] = p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pytest.fail("launchers still running after "
                    f"{timeout} s:\n" + "\n".join(f"--- {k}\n{_tail(log)}" for k, log in logs.items()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


@pytest.mark.slurm
def test_selftest_across_two_nodes_with_launch_nnodes(box: dict[str, str], tmp_path: Path) -> None:
    """``moonrt launch --nnodes 2`` on node1 and node2: 4 ranks, collectives and MoonEP checked across the nodes;
    rank 0's store listens on the master address only, every rank's sockets on its node's address or loopback."""
    logs = {n: tmp_path / f"{n}.log" for n in NODES}
    tail = ["--selftest", "--", "--suite", "collectives,ep", *SELFTEST_SMALL]
    with Watch() as watch:
        procs = {"node1": on_node("node1", [*launch_args(0, "selftest", 29510), *tail, "--report", "r.json"],
                                  tmp_path, box, logs["node1"]),
                 "node2": on_node("node2", [*launch_args(1, "selftest", 29510), *tail], tmp_path, box, logs["node2"])}
        codes = wait_all(procs, logs)
    assert codes == {"node1": 0, "node2": 0}, "\n".join(_tail(log) for log in logs.values())
    report = verify_selftest_report(tmp_path / "r.json", 4, "torchrun")
    assert [r["local_rank"] for r in report["ranks"]] == [0, 1, 0, 1]
    assert "[rank 2]" in logs["node2"].read_text() and "[rank 2]" not in logs["node1"].read_text()
    assert_only_on_the_box(watch.seen)  # the store on node1's address (the master address), gloo on eth0
    assert any(port == 29510 and addr == "10.213.77.11" for addr, port, _ in watch.seen["node1"]), watch.seen


@pytest.mark.slurm
def test_a_rank_of_another_job_cannot_join(box: dict[str, str], tmp_path: Path) -> None:
    """Node 2 of job B reaches job A's store (same master address and port): its ranks refuse to join, naming both
    jobs; job A's own node 2 then joins and the job runs."""
    logs = {k: tmp_path / f"{k}.log" for k in ("a1", "b2", "a2")}
    tail = ["--selftest", "--", "--suite", "collectives", "--sizes", "4K", "--iters", "1"]
    a1 = on_node("node1", [*launch_args(0, "job-a", 29520), *tail], tmp_path, box, logs["a1"])
    b2 = on_node("node2", [*launch_args(1, "job-b", 29520), *tail], tmp_path, box, logs["b2"])
    codes = wait_all({"b2": b2}, logs)
    text = logs["b2"].read_text()
    assert codes["b2"] != 0, text
    assert ("belongs to moonrt launch job job-a, but this process (rank 2) belongs to moonrt launch job job-b" in text
            or "(rank 3) belongs to moonrt launch job job-b" in text), text
    a2 = on_node("node2", [*launch_args(1, "job-a", 29520), *tail], tmp_path, box, logs["a2"])
    codes = wait_all({"a1": a1, "a2": a2}, logs)
    assert codes == {"a1": 0, "a2": 0}, "\n".join(_tail(log) for log in logs.values())


@pytest.mark.slurm
@pytest.mark.slow
def test_a_node_killed_mid_step_is_named_and_leaves_no_orphans(box: dict[str, str], tmp_path: Path) -> None:
    """A 2-node ``--ep 2 --pp 2`` training job; every process of node2's namespace is killed (its launcher, ranks and
    slurmd: the node is gone) after the first step: node1's launcher ends the job within the collective timeout,
    naming node2's ranks, and nothing of the job is left on node1."""
    logs = {n: tmp_path / f"{n}.log" for n in NODES}
    train = ["--", sys.executable, "-m", "moonrt.cli", "train", *FLAGS, "--steps", "500",
             "--out", "run", "--metrics", "run.jsonl", "--ep", "2", "--pp", "2"]
    procs = {n: on_node(n, [*launch_args(i, "kill-node", 29530, timeout=30), *train], tmp_path, box, logs[n])
             for i, n in enumerate(NODES)}
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "run.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), \
                "\n".join(_tail(log) for log in logs.values())
            time.sleep(0.2)
        killed = namespace_pids("mrtbox-n2")
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = procs["node1"].wait(timeout=120)
        took = time.monotonic() - t0
        text = logs["node1"].read_text()
        assert code != 0, text
        assert "lost the connection to ranks [2, 3] on node2 (10.213.77.12)" in text, text[-4000:]
        assert took < 30, (took, text[-4000:])  # noticed before any collective timeout (--timeout 30) had to fire
        left = {pid: _comm(pid) for pid in namespace_pids("mrtbox-n1")}
        assert set(left.values()) <= {"slurmd"}, f"left on node1 after the job: {left}"
    finally:
        wait_all(procs, logs, timeout=60)
        subprocess.run([*BOX, "restart-node", "node2"], check=True, timeout=120)


def namespace_pids(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30, check=True)
    return [int(p) for p in res.stdout.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "(gone)"


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-id", "j"], "--master-addr = None: expected the address or host "
     "name of node 0's host (with --nnodes = 2)"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "node1", "--rdzv-id", "j"],
     "--node-rank = 2: expected an integer in [0, 2) (--nnodes = 2)"),
    (["--nnodes", "2", "--master-addr", "node1"],
     "--rdzv-id = None: expected a job id shared by every node's launcher"),
    (["--master-addr", "node1"], "--master-addr = 'node1': expected only with --nnodes > 1"),
    (["--nnodes", "0"], "--nnodes = 0: expected an integer >= 1"),
    (["--nnodes", "2", "--master-addr", "node1", "--rdzv-id", "j", "--master-port", "70000"],
     "--master-port = 70000: expected a TCP port in 1..65535"),
])
def test_launch_nnodes_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Runs anywhere: one line naming the flag, exit 2, before anything starts."""
    from moonrt.cli import main

    assert main(["launch", "-n", "2", *argv, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_describe_lost_peers_names_the_ranks_of_the_address_gloo_reports() -> None:
    """Runs anywhere: gloo's "closed by peer [addr]:port" and "Read error [addr]:port: ... reset by peer" -> that
    host's ranks; this rank's own host is not named."""
    from moonrt.cluster.peers import describe_lost_peers

    peers = {0: ("node1", "10.0.0.1"), 1: ("node1", "10.0.0.1"), 2: ("node2", "10.0.0.2"), 3: ("node2", "10.0.0.2")}
    text = "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:40587. This is typically caused by"
    assert describe_lost_peers(text, peers, me=0).startswith(
        "moonrt: lost the connection to ranks [2, 3] on node2 (10.0.0.2): ")
    assert describe_lost_peers("Connection reset by peer [::ffff:10.0.0.2]:1", peers, me=1).startswith(
        "moonrt: lost the connection to ranks [2, 3] on node2")
    assert describe_lost_peers(text, peers, me=2) is None  # its own host: the launcher names the failed rank
    assert describe_lost_peers("some other error", peers, me=0) is None
    # the reset form (seen when a whole node's namespace was killed): address before the reason
    reset = "[pair.cc:537] Read error [10.0.0.2]:58549: Connection reset by peer. This is typically caused by"
    assert describe_lost_peers(reset, peers, me=0).startswith("moonrt: lost the connection to ranks [2, 3] on node2")


# ---------------------------------------------------------------------------------------------------------------
# preemption of a 2-node SLURM job


def job_state(job_id: str, env: dict[str, str]) -> dict[str, str]:
    res = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", res.stdout))


def wait_state(job_id: str, env: dict[str, str], pred, what: str, log: Path, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = job_state(job_id, env)
        if pred(state):
            return state
        assert state.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), f"{state}\n{_tail(log)}"
        assert time.monotonic() < deadline, f"job {job_id}: not {what} after {timeout} s: {state}\n{_tail(log)}"
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_job_preempted_with_usr1_saves_exits_75_requeues_and_resumes_bit_identically(
        box: dict[str, str], tmp_path: Path) -> None:
    """``moonrt sbatch -N 2 --ntasks-per-node 1 --requeue``: ``scancel --signal=USR1 --batch`` after step 2; each
    node's rank finishes its step, the job checkpoints and its step exits 75; the job is requeued, resumes on the
    two nodes and ends with the losses, gradient norms, parameters and optimizer state of an uninterrupted 2-rank
    run (``moonrt launch -n 2`` on this host, started at the same time): bit-identical."""
    from cluster.helpers import MOONRT, STEPS, _assert_same_run, _config, _finish, _train, _wait_for_step

    cfg = _config(tmp_path)
    run, ref, log = tmp_path / "run", tmp_path / "ref", tmp_path / "requeue.log"
    _main_here(tmp_path, ("sbatch", "-N", "2", "--ntasks-per-node", "1", "--requeue", "--timeout", "120",
                          "--job-name", "box-requeue", "--log", str(log), "--output", "requeue.sbatch", "--",
                          *MOONRT, *_train(cfg, run)))
    reference = subprocess.Popen([*MOONRT, "launch", "-n", "2", "--timeout", "120", "--", *MOONRT,
                                  *_train(cfg, ref)], cwd=tmp_path, env=box, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
    res = subprocess.run(["sbatch", "--parsable", "requeue.sbatch"], cwd=tmp_path, env=box, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    try:
        _wait_for_step(run, 2, lambda: job_state(job_id, box).get("JobState") in ("PENDING", "RUNNING"))
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=box, check=True, timeout=30)
        wait_state(job_id, box, lambda s: s.get("Restarts") == "1" and s.get("JobState") == "PENDING", "requeued",
                   log)
        # eligible ~2 minutes after a requeue: now + 3 s (not now: test_preempt.test_slurm_requeue_resumes_and_matches)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"], env=box, check=True, timeout=30)
        state = wait_state(job_id, box, lambda s: s.get("JobState") == "COMPLETED", "completed", log)
    finally:
        subprocess.run(["scancel", job_id], env=box, capture_output=True, timeout=30)
    text = log.read_text()
    assert state["NodeList"] == "node[1-2]", state
    step = int(re.search(r"stopped by SIGUSR1 after step (\d+) of", text).group(1))
    assert 2 <= step < STEPS, text[-4000:]
    # a rank exits 75 after the agreed checkpoint; srun --kill-on-bad-exit may then end the other node's rank first
    # (the step's code is 75, or 143: moonrt.cluster.sbatch's module doc), and the script requeues on either
    assert re.search(rf"srun: error: node[12]: task [01]: Exited with exit code {PREEMPTED_EXIT}", text), text[-4000:]
    assert re.search(rf"job step stopped \(exit ({PREEMPTED_EXIT}|143)\) after the stop signal: requeueing job "
                     rf"{job_id} \(restart 0\)", text), text[-4000:]
    code, out = _finish(reference)
    assert code == 0, out[-4000:]
    _assert_same_run(run, ref)


# ---------------------------------------------------------------------------------------------------------------
# mpiexec (MPICH's Hydra) with a host list across the two nodes


@pytest.mark.slurm
def test_mpiexec_with_a_host_list_across_two_nodes(box: dict[str, str], tmp_path: Path) -> None:
    """``mpiexec -launcher ssh -launcher-exec .ci/box-ssh -hosts node1,node2 -ppn 2 -n 4`` started on node1: Hydra
    starts node2's proxy through the box's ssh stand-in; the 4 ranks join through the MPI path (rank 0's store on
    node1's bridge address, sent through MPI) and the self-test's collectives are right on every rank."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        cluster_unavailable(f"no mpiexec beside {sys.executable} (pip install moonrt[mpi]: mpi4py and mpich)")
    log = tmp_path / "mpi.log"
    proc = on_node_argv("node1", ["timeout", "180", str(mpiexec), "-launcher", "ssh", "-launcher-exec",
                                  str(ROOT / ".ci" / "box-ssh"), "-hosts", "node1,node2", "-ppn", "2", "-n", "4",
                                  sys.executable, "-m", "moonrt.cli", "selftest", "--suite", "collectives", "--sizes",
                                  "4K", "--iters", "1", "--report", "r.json"], tmp_path, box, log)
    codes = wait_all({"mpiexec": proc}, {"mpiexec": log})
    assert codes["mpiexec"] == 0, _tail(log)
    verify_selftest_report(tmp_path / "r.json", 4, "mpi")


@pytest.mark.slurm
@pytest.mark.slow
def test_torchrun_nnodes_2_runs_moonrt_train_across_two_nodes(box: dict[str, str], tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint node1:PORT`` on each node, running
    ``moonrt train --ep 2``: the ranks are clients of torchrun's agent store; one step trains, rank 0 (on node1)
    writes the metrics. (torchrun's agent store listens on every interface of node1: README, *Running on several
    nodes*; only ``moonrt launch``/``moonrt sbatch``/MPI bind one address.)"""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        cluster_unavailable(f"no torchrun beside {sys.executable}")
    logs = {n: tmp_path / f"{n}.log" for n in NODES}
    argv = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "node1:29540", "--rdzv-id", "torchrun-box", "-m", "moonrt.cli", "train", *FLAGS, "--until", "1",
            "--out", "run", "--metrics", "run.jsonl", "--ep", "2", "--dist-timeout", "60"]
    procs = {n: on_node_argv(n, ["timeout", "180", *argv], tmp_path, box, logs[n]) for n in NODES}
    codes = wait_all(procs, logs)
    assert codes == {"node1": 0, "node2": 0}, "\n".join(_tail(log) for log in logs.values())
    assert list(_metrics(tmp_path / "run.jsonl")) == [1]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_of_a_slurm_job_killed_mid_step_is_named_and_leaves_no_orphans(box: dict[str, str],
                                                                               tmp_path: Path) -> None:
    """The SLURM form of the dead node: a 2-node x 2-rank ``moonrt sbatch`` training job; every process of node2's
    namespace (slurmd, slurmstepd, ranks) killed after the first step. node1's ranks fail at once naming node2's ranks
    in the job's log; SLURM declares the node dead after its SlurmdTimeout, ends the step and requeues the job
    (``JobRequeue``'s default; cancelled here); nothing of the job is left on node1."""
    log = tmp_path / "kill.log"
    _main_here(tmp_path, ("sbatch", "-N", "2", "--ntasks-per-node", "2", "--timeout", "30", "--job-name", "box-kill",
                          "--log", "kill.log", "--output", "kill.sbatch", "--", sys.executable, "-m", "moonrt.cli",
                          "train", *FLAGS, "--steps", "500", "--out", "run", "--metrics", "run.jsonl", "--ep", "2",
                          "--pp", "2"))
    res = subprocess.run(["sbatch", "--parsable", "kill.sbatch"], cwd=tmp_path, env=box, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "run.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline, _tail(log)
            assert job_state(job_id, box).get("JobState") in ("PENDING", "CONFIGURING", "RUNNING"), _tail(log)
            time.sleep(0.2)
        for pid in namespace_pids("mrtbox-n2"):
            os.kill(pid, signal.SIGKILL)
        state = wait_state(job_id, box, lambda s: s.get("JobState") != "RUNNING", "ended", log, timeout=120)
        text = log.read_text()
        assert "lost the connection to ranks [2, 3] on node2 (10.213.77.12)" in text, text[-4000:]
        assert "Node failure on node2" in text or state.get("Reason") == "NodeDown" or "NODE FAILURE" in text, \
            (state, text[-4000:])
        deadline = time.monotonic() + 30  # slurmstepd's own cleanup (KillWait 5 s) may still be running
        while set((left := {pid: _comm(pid) for pid in namespace_pids("mrtbox-n1")}).values()) - {"slurmd"}:
            assert time.monotonic() < deadline, f"left on node1 after the job: {left}"
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job_id], env=box, capture_output=True, timeout=30)
        subprocess.run([*BOX, "restart-node", "node2"], check=True, timeout=120)
