"""Launcher detection from fake environments (no processes): torchrun, SLURM, MPI, single, and bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from cluster.helpers import clean_env, listening_sockets

from moonrt.cluster.detect import (
    SLURM_PORT_BASE,
    Rendezvous,
    _multi_node,
    detect_rendezvous,
    parse_hostlist,
    slurm_port,
)
from moonrt.cluster.env import default_dist_config
from moonrt.cluster.store import master_store, rendezvous_bind_host
from moonrt.config import ConfigError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4321",
         "SLURM_STEP_ID": "2", "SLURM_STEP_NODELIST": "gpu[03-06]", "SLURM_JOB_NODELIST": "gpu[01-06]",
         "SLURM_NTASKS": "16"}


def test_torchrun():
    assert detect_rendezvous(TORCHRUN) == Rendezvous(3, 4, 1, "node7", 29400, "torchrun")


def test_torchrun_wins_over_slurm_and_local_rank_defaults_to_rank():
    env = {**SLURM, **TORCHRUN}
    del env["LOCAL_RANK"]
    assert detect_rendezvous(env) == Rendezvous(3, 4, 3, "node7", 29400, "torchrun")


@pytest.mark.parametrize(
    ("drop", "missing"),
    [(["WORLD_SIZE"], "WORLD_SIZE"), (["MASTER_ADDR", "MASTER_PORT"], "MASTER_ADDR, MASTER_PORT"),
     (["RANK"], "RANK")],
)
def test_torchrun_partial(drop, missing):
    env = {k: v for k, v in TORCHRUN.items() if k not in drop}
    with pytest.raises(ValueError, match=rf"incomplete torchrun environment: .* missing {missing}$"):
        detect_rendezvous(env)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("RANK", "x", r"RANK = 'x': expected an integer >= 0"),
     ("RANK", "4", r"RANK = 4: expected a rank below the world size 4"),
     ("WORLD_SIZE", "0", r"WORLD_SIZE = '0': expected an integer >= 1"),
     ("MASTER_PORT", "70000", r"MASTER_PORT = 70000: expected a TCP port in 1..65535")],
)
def test_torchrun_bad_values(key, value, message):
    with pytest.raises(ValueError, match=message):
        detect_rendezvous({**TORCHRUN, key: value})


def test_slurm_step():
    r = detect_rendezvous(SLURM)
    # world from SLURM_STEP_NUM_TASKS (8), never SLURM_NTASKS (16); master = first host of the step
    assert r == Rendezvous(5, 8, 1, "gpu03", slurm_port(4321, 2), "slurm")
    assert slurm_port(4321, 2) == SLURM_PORT_BASE + 4321 * 4 + 2


def test_slurm_job_nodelist_fallback_and_master_override():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert detect_rendezvous(env).master_addr == "gpu01"
    env.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")
    r = detect_rendezvous(env)
    assert (r.master_addr, r.master_port, r.source) == ("10.0.0.1", 1234, "slurm")


def test_slurm_ports_differ_between_steps_and_jobs():
    ports = {slurm_port(job, step) for job in range(1000, 1100) for step in range(4)}
    assert len(ports) == 100 * 4
    assert all(SLURM_PORT_BASE <= p < 32768 for p in ports)  # below Linux's ephemeral ports


def test_slurm_batch_script_outside_srun_is_an_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "vm"}
    with pytest.raises(ValueError, match=r"SLURM_PROCID is set but SLURM_STEP_NUM_TASKS is missing"):
        detect_rendezvous(env)


@pytest.mark.parametrize("drop", ["SLURM_LOCALID", "SLURM_JOB_ID"])
def test_slurm_partial(drop):
    env = {k: v for k, v in SLURM.items() if k != drop}
    with pytest.raises(ValueError, match=rf"incomplete SLURM environment: .* missing {drop}$"):
        detect_rendezvous(env)


def test_slurm_without_nodelist():
    env = {k: v for k, v in SLURM.items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match=r"missing SLURM_STEP_NODELIST and SLURM_JOB_NODELIST"):
        detect_rendezvous(env)


def test_slurm_bad_nodelist():
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST = 'gpu\[03-': .*unmatched '\['"):
        detect_rendezvous({**SLURM, "SLURM_STEP_NODELIST": "gpu[03-"})


def test_openmpi_and_mpich():
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert detect_rendezvous(ompi) == Rendezvous(2, 4, 0, None, None, "mpi")
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h", "MASTER_PORT": "99"}
    assert detect_rendezvous(pmi) == Rendezvous(1, 3, 1, "h", 99, "mpi")


def test_mpi_partial():
    with pytest.raises(ValueError, match=r"incomplete MPICH/PMI environment: PMI_RANK set but missing PMI_SIZE, "
                                         r"MPI_LOCALRANKID"):
        detect_rendezvous({"PMI_RANK": "0"})


def test_mpiexec_inside_slurm_allocation_prefers_mpi():
    # Hydra starts one proxy per node with srun: SLURM sees 1 task, MPI sees 4 ranks
    env = {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"}
    assert detect_rendezvous(env) == Rendezvous(3, 4, 3, None, None, "mpi")
    env = {k: v for k, v in env.items() if k != "SLURM_STEP_NUM_TASKS"}  # mpiexec in a batch script
    assert detect_rendezvous(env).source == "mpi"


def test_single_process():
    assert detect_rendezvous({"HOME": "/root", "MASTER_ADDR": "x"}) == Rendezvous(0, 1, 0, None, None, "single")


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [("vm", ["vm"]),
     ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
     ("a[8-11]", ["a8", "a9", "a10", "a11"]),
     ("a[098-100]", ["a098", "a099", "a100"]),
     ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
     ("x-[1,3]-y,z", ["x-1-y", "x-3-y", "z"])],
)
def test_parse_hostlist(spec, hosts):
    assert parse_hostlist(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "message"),
    [("a[1-2", r"unmatched '\['"), ("a]1", r"unmatched '\]'"), ("a[3-1]", r"runs backwards"),
     ("a[x]", r"bad range 'x'"), ("a,,b", r"empty host name"), ("a[[1]]", r"nested '\['")],
)
def test_parse_hostlist_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_hostlist(spec)


def test_timeout_from_environment():
    assert default_dist_config({}).timeout_s == 300.0
    assert default_dist_config({"MOONRT_DIST_TIMEOUT": "7.5"}).timeout_s == 7.5
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ConfigError, match=rf"MOONRT_DIST_TIMEOUT = '{bad}': expected a positive number"):
            default_dist_config({"MOONRT_DIST_TIMEOUT": bad})


@pytest.mark.slow
def test_single_process_selftest_and_partial_environment_in_a_real_process():
    """init_distributed for real: a plain process is a 1-rank job; a partial environment fails clearly."""
    cmd = [sys.executable, "-m", "moonrt.cli", "selftest", "--suite", "collectives", "--sizes", "4K", "--iters", "1"]
    res = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "1 ranks via single" in res.stdout and "PASS" in res.stdout
    res = subprocess.run(cmd, env={**clean_env(), "RANK": "0"}, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "incomplete torchrun environment: RANK set but missing WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in res.stderr


def test_rendezvous_bind_host():
    assert rendezvous_bind_host("127.0.0.1", multi_node=False, environ={}) == "127.0.0.1"
    assert rendezvous_bind_host("localhost", multi_node=None, environ={}) in ("127.0.0.1", "::1")
    assert rendezvous_bind_host("10.1.2.3", multi_node=True, environ={}) == "10.1.2.3"  # the named interface
    # an explicit choice wins, wildcard included (only when asked for)
    assert rendezvous_bind_host("127.0.0.1", multi_node=True, environ={"MOONRT_RDZV_HOST": "0.0.0.0"}) == "0.0.0.0"
    with pytest.raises(ValueError, match=r"MASTER_ADDR = '127.0.0.1' resolves to the loopback address 127.0.0.1 .* "
                                         r"set dist.rdzv_host in the job config \(or MOONRT_RDZV_HOST: moonrt "
                                         r"sbatch --rdzv-host\)"):
        rendezvous_bind_host("127.0.0.1", multi_node=True, environ={})
    with pytest.raises(ValueError, match=r"MASTER_ADDR = 'no-such-host.invalid': cannot resolve"):
        rendezvous_bind_host("no-such-host.invalid", multi_node=None, environ={})
    with pytest.raises(ValueError, match=r"MOONRT_RDZV_HOST = 'no-such-host.invalid': cannot resolve"):
        rendezvous_bind_host("127.0.0.1", multi_node=None, environ={"MOONRT_RDZV_HOST": "no-such-host.invalid"})


def test_multi_node_from_launcher_variables():
    torchrun = Rendezvous(0, 8, 0, "h", 1, "torchrun")
    assert _multi_node({"LOCAL_WORLD_SIZE": "4"}, torchrun) is True
    assert _multi_node({"LOCAL_WORLD_SIZE": "8"}, torchrun) is False
    assert _multi_node({}, torchrun) is None
    slurm = Rendezvous(0, 8, 0, "h", 1, "slurm")
    assert _multi_node({"SLURM_STEP_NUM_NODES": "2"}, slurm) is True
    assert _multi_node({"SLURM_STEP_NODELIST": "vm"}, slurm) is False
    assert _multi_node({"SLURM_JOB_NODELIST": "gpu[1-2]"}, slurm) is True


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_master_store_listens_on_the_given_address_only():
    import torch.distributed as dist

    def mine(port: int) -> list[tuple[str, int]]:
        return [s for s in listening_sockets(os.getpid()) if s[1] == port]

    timeout = timedelta(seconds=30)
    store = master_store("127.0.0.1", 0, 2, timeout)
    assert mine(store.port) == [("127.0.0.1", store.port)]
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timeout)
    client.set("k", "v")
    assert store.get("k") == b"v"
    wildcard = master_store("0.0.0.0", 0, 1, timeout)  # every interface only when asked for
    assert mine(wildcard.port) == [("0.0.0.0", wildcard.port)]
    with pytest.raises(ValueError, match=r"cannot open the rendezvous store on 203.0.113.254:0: Cannot assign "
                                         r"requested address \(rank 0 must run on the host"):
        master_store("203.0.113.254", 0, 1, timeout)  # TEST-NET-3: not an address of this host


def test_launcher_name_tells_moonrt_launch_from_torchrun():
    """Issue 49 item 9: ``moonrt launch`` sets torchrun's variables; the selftest's first line names it, not
    torchrun (its ranks carry MOONRT_LAUNCHER_PID)."""
    from moonrt.cluster.detect import detect_rendezvous, launcher_name
    from moonrt.cluster.lifeline import LAUNCHER_PID_ENV

    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    rdzv = detect_rendezvous(env)
    assert launcher_name(rdzv, env) == "torchrun"
    assert launcher_name(rdzv, {**env, LAUNCHER_PID_ENV: "123"}) == "moonrt launch"
    assert launcher_name(detect_rendezvous({}), {}) == "single"
