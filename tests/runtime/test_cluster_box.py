"""Multi-node jobs on the cluster in a box (``.ci/cluster-box.sh``: two SLURM nodes, each its own network
namespace, address, host name and ``/etc/hosts`` on a private bridge; issue 35).

- A 2-node x 2-rank ``--ep 2 --pp 2`` ``moonrt train`` job (``moonrt sbatch -N 2 --ntasks-per-node 2``), resumed
  from a single-process checkpoint, equals the single process's step within 1e-5 (teacher-forced: the scheme and
  the helpers of ``tests/jobs/test_pp_train.py``); while it runs, ``ss`` inside each node's namespace shows every
  socket the ranks listen on bound to that node's bridge address or to loopback, never a wildcard, and nothing at
  all (SLURM's own daemons included) on an address outside the bridge or loopback.

The tests skip where the box is not running (with the command that starts it) and fail instead under
``MOONRT_REQUIRE_CLUSTER=1`` (CI, whose ``.ci/run`` starts the box).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from jobs.helpers import FLAGS, _assert_same_step, _ckpt, _here, _main_here, _metrics, _run
from runtime.test_cluster_report import clean_env, cluster_unavailable

ROOT = Path(__file__).resolve().parents[2]
BOX_CONF = Path(os.environ.get("MOONRT_BOX_CONF", "/var/spool/moonrt-box/slurm.conf"))
NODES = {"node1": ("mrtbox-n1", "10.213.77.11"), "node2": ("mrtbox-n2", "10.213.77.12")}
"""Node name -> (network namespace, bridge address), as .ci/cluster-box.sh makes them."""
BRIDGE = ipaddress.ip_network("10.213.77.0/24")
START = "start it with `sudo bash .ci/cluster-box.sh start` (.ci/run does)"
JOB_TIMEOUT_S = 240

pytestmark = [pytest.mark.slurm]


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
    from moonrt.cluster.env import interface_of, loopback_interface, route_interface, set_gloo_interface

    lo = loopback_interface()
    assert interface_of("127.0.0.1") == lo and route_interface("127.0.0.1") == lo
    env: dict[str, str] = {}
    assert set_gloo_interface("127.0.0.1", env) == lo and env == {"GLOO_SOCKET_IFNAME": lo}
    env = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert set_gloo_interface("127.0.0.1", env) == "eth7" and env == {"GLOO_SOCKET_IFNAME": "eth7"}
    env = {}
    assert set_gloo_interface("no-such-host.invalid", env) is None and env == {}


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
