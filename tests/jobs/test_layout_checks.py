"""Per-layout checks of ``moonrt train`` (issue 30 item 3): one training step, one held-out eval, a checkpoint and a
resumed step of every layout, run with every checker of :data:`device_discipline.CHECKERS` active in every rank
(the device-discipline checker: no tensor placed off the job's device from moonrt code; the NCCL-op check,
tests/collective_check.py), so each layout's step is paid for once whatever the number of checkers.

Layouts: one process (plain, each activation-memory policy: keep, fp8, host, disk, recompute; packed documents;
``--dtype bf16``) in this process; ``--ep 2``, ``--cp 2``, ``--pp 2 --vpp 2``, ``--pp 2`` with the naive AttnRes
hops, ``--zero 1``, ``--optimizer muon --zero 1`` and ``--pp 2 --dtype bf16`` on the same two gloo ranks, one after
another (one ``dist_run``: the ranks keep their process group across the runs). The runs happen once per session
(:func:`layout_violations`); each layout is its own test case over their results.

The checker itself is tested here too: a ``torch.zeros(n)`` without a device and an explicit host copy planted in a
moonrt frame are caught, a sanctioned site and code outside moonrt are not.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from device_discipline import CHECKERS, MOONRT, SANCTIONED, device_discipline, literal_host_devices
from dist import dist_run

FLAGS = ["--steps", "2", "--seed", "0", "--batch-size", "4", "--seq-len", "16", "--eval-every", "1",
         "--set", "optim.eval_windows=4", "--threads", "1", "--no-progress"]
"""The smallest job that runs every layout: 4 rows (``--pp 2 --vpp 2`` takes 4 micro-batches), 16 tokens (``--cp 2``
halves them), an eval after each step."""

EOS = 12  # form feed: the byte that ends each document of the test corpus

POLICIES = {
    "keep": "default: keep\n",
    "fp8": "default: fp8\n",
    "host": "default: host\n",
    "disk": "default: disk\ndisk_path: {tmp}\ndisk_capacity_mib: 64\n",
    "recompute": "default: keep\nrules:\n  - {{match: 'layers.*.moe', policy: recompute}}\n",
}
"""The activation-memory policies (``moonrt.memory.policy``), one run each."""

SINGLE: dict[str, list[str]] = {"one process": []} | {
    f"policy {name}": ["--memory-policy", "{tmp}/" + f"{name}.yaml"] for name in POLICIES} | {
    "packing": ["--pack-documents", "--eos-id", str(EOS)], "bf16": ["--dtype", "bf16"]}
"""One-process layouts: the flags each adds to :data:`FLAGS` (``{tmp}``: the run's directory)."""

MULTI: dict[str, list[str]] = {
    "--ep 2": ["--ep", "2"],
    "--cp 2": ["--cp", "2"],
    "--pp 2 --vpp 2": ["--pp", "2", "--vpp", "2", "--microbatches", "4"],
    "--pp 2 naive": ["--pp", "2", "--microbatches", "2", "--attn-res-comm", "naive"],
    "--zero 1": ["--zero", "1"],
    "--optimizer muon --zero 1": ["--optimizer", "muon", "--zero", "1"],
    "--pp 2 bf16": ["--pp", "2", "--microbatches", "2", "--dtype", "bf16"],
}
"""Two-rank layouts: the flags each adds to :data:`FLAGS`."""

def _corpus(tmp: Path) -> Path:
    path = tmp / "docs.txt"
    if not path.exists():
        docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3) for i in range(300)]
        path.write_text("".join(d + chr(EOS) for d in docs))
    return path


DEVICE = "cuda" if os.environ.get("MOONRT_TEST_DEVICE") == "cuda" and torch.cuda.is_available() else "cpu"
"""Where the one-process layouts run: the CPU, or CUDA under ``MOONRT_TEST_DEVICE=cuda`` (``tests/conftest.py``); the
two-rank ones run on the CPU (``dist_run``'s ranks join a gloo group)."""


CALLS: dict[str, list[Any]] = {}
"""Layout -> the collective recorder's calls (every rank's) of its run, in this process (one entry per run)."""


def _layout_runs(tmp: Path, name: str, extra: list[str], device: str = DEVICE) -> dict[str, list[str]]:
    """Run layout ``name`` in this process (one rank of it) on ``device``: step 1 with its eval and checkpoint, then
    a resumed step 2, every checker of :data:`CHECKERS` active throughout. Returns each checker's findings
    (``"error"``: the run's exception, if it raised)."""
    from moonrt.cli import main

    out = tmp / name.replace(" ", "_").replace("-", "")
    flags = [*FLAGS, "--corpus", str(_corpus(tmp)), "--out", str(out), "--device", device,
             *(f.format(tmp=tmp) for f in extra)]
    found: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        lists = {getattr(c, "__name__", repr(c)): stack.enter_context(c(device)) for c in CHECKERS}
        try:
            codes = [main(["train", *flags, "--until", "1"]), main(["train", *flags, "--resume"])]
            if codes != [0, 0]:
                found["error"] = [f"moonrt train exited {codes}"]
        except BaseException:  # noqa: BLE001 (reported as this layout's failure; the other layouts still run)
            found["error"] = [traceback.format_exc()]
    found |= {k: [str(v) for v in vs] for k, vs in lists.items()}
    CALLS.setdefault(name, []).append(lists.get("collective_check", None) and lists["collective_check"].calls)
    return found


def _policies(tmp: Path) -> None:
    for name, text in POLICIES.items():
        (tmp / f"{name}.yaml").write_text(text.format(tmp=tmp))


def _ranks(rank: int, world: int, tmp: Path) -> dict[str, dict[str, list[str]]]:
    """Every layout of :data:`MULTI` on this rank of two, one after another on the group ``dist_run`` made (the
    launcher's variables point ``moonrt train`` at it; leaving it is skipped until the last layout ran)."""
    import moonrt.cluster.env as env

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")  # init_distributed finds the group joined: no rendezvous
    leave, env.shutdown_distributed = env.shutdown_distributed, lambda: None
    try:
        found = {name: _layout_runs(tmp, name, extra, "cpu") for name, extra in MULTI.items()}
        return found | ({"calls": {name: CALLS[name] for name in MULTI}} if rank == 0 else {})
    finally:
        env.shutdown_distributed = leave


@pytest.fixture(scope="session")
def layout_violations(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[str]]]:
    """Each layout's findings per checker: the one-process layouts run here (threads and RNG restored after), the
    two-rank ones in one ``dist_run``."""
    tmp = tmp_path_factory.mktemp("layouts")
    _policies(tmp)
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            got = {name: _layout_runs(tmp, name, extra) for name, extra in SINGLE.items()}
    finally:
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()
    ranks = dist_run(_ranks, 2, tmp, timeout=600)
    CALLS.update(ranks[0].pop("calls"))
    ranks[1].pop("calls", None)
    for name in MULTI:  # every rank's findings, each said with its rank
        got[name] = {k: [f"rank {r}: {v}" for r, found in enumerate(ranks) for v in found[name].get(k, [])]
                     for k in set().union(*(found[name] for found in ranks))}
    return got


@pytest.mark.slow  # the session fixture runs 8 one-process and 7 two-rank layouts (minutes): not the fast lane
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [*SINGLE, *MULTI])
def test_layout_passes_every_checker(layout: str, layout_violations: dict[str, dict[str, list[str]]]) -> None:
    """One step, an eval, a checkpoint and a resumed step of the layout: every checker found nothing."""
    found = layout_violations[layout]
    assert "error" not in found, found["error"][0]
    assert set(found) == {getattr(c, "__name__", repr(c)) for c in CHECKERS}
    for checker, violations in found.items():
        assert not violations, f"{layout}: {checker}:\n" + "\n".join(sorted(set(violations)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_doc_table_names_every_recorded_call(layout_violations: dict[str, dict[str, list[str]]]) -> None:
    """Every (call, group) the layout runs recorded has a row in docs/ARCHITECTURE.md's collectives table."""
    from jobs.helpers import missing_doc_rows

    assert set(CALLS) >= set(MULTI)
    assert not missing_doc_rows(c for runs in CALLS.values() for c in runs if c)


# ---- the checker itself ---------------------------------------------------------------------------------------------


def _planted(source: str, rel: str, name: str = "planted") -> Any:
    """A function compiled from ``source`` as if it were written in ``moonrt/<rel>`` (its frames' file name)."""
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(source, str(MOONRT / rel), "exec"), namespace)
    return namespace[name]


def test_planted_factory_without_device_is_caught() -> None:
    planted = _planted("def planted(n):\n    return torch.zeros(n)\n", "parallel/planted.py")
    with device_discipline("cpu") as found:
        planted(3)
    assert [str(v) for v in found] == ["moonrt/parallel/planted.py:2 in planted: torch.zeros without device="]


def test_planted_host_copies_and_other_devices_are_caught() -> None:
    planted = _planted("def planted(x):\n    a = x.cpu()\n    b = x.to('cpu')\n    c = torch.arange(2, device='cpu')\n"
                       "    d = torch.from_numpy(x.numpy())\n    e = x.new_zeros(2, device='meta')\n"
                       "    f = x.to(torch.float64)\n    g = torch.ones(2, device=x.device)\n"
                       "    return a, b, c, d, e, f, g\n", "comm/planted.py")
    with device_discipline("cpu") as found:
        planted(torch.ones(2))
    got = [(v.where.rsplit(":", 1)[1], v.what) for v in found]
    assert got == [("2", ".cpu() (a host copy)"),
                   ("3", ".to() to device 'cpu' spelled as a string (an explicit host placement)"),
                   ("4", "torch.arange on device 'cpu' spelled as a string (an explicit host placement)"),
                   ("5", ".numpy() (a host copy)"), ("5", "torch.from_numpy (a host tensor)"),
                   ("6", "new_zeros on device meta (the job's is cpu)")], got  # f, g: dtype only, the input's device


def test_sanctioned_sites_tests_and_torch_internals_are_not_flagged() -> None:
    """A sanctioned site's explicit host work passes (its factory without a device does not); a test's tensors and
    torch's own code called from moonrt pass."""
    sanctioned = _planted("def host_tensor(a, device):\n    b = torch.zeros(2, device='cpu').numpy()\n"
                          "    return torch.from_numpy(a).to(device), torch.zeros(2)\n", "jobs/train/device.py",
                          "host_tensor")
    with device_discipline("cpu") as found:
        torch.zeros(3)  # a test's own tensor
        sanctioned(torch.ones(2).numpy(), torch.device("cpu"))
        torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).zero_grad()  # torch's code, called from here
    assert [str(v) for v in found] == ["moonrt/jobs/train/device.py:3 in host_tensor: torch.zeros without device="]
    assert all(why for why in SANCTIONED.values())


HOST_DEVICE_SPELLED = {
    "moonrt/jobs/train/device.py": "bind_device: the device of a job that runs on the CPU",
    "moonrt/comm/parallelism.py": "Parallelism.device's default: a one-process runtime before the job binds it",
    "moonrt/comm/mesh.py": "the default group's gloo backend looked up by device (its timeout), no tensor made",
    "moonrt/jobs/selftest/common.py": "the self-test suites' device under gloo",
    "moonrt/memory/remote.py": "channel_device: a gloo remote-offload channel's tensors live on the host",
    "moonrt/comm/transport/shm.py": "group_timeout: the collective timeout of the group's CPU (gloo) backend; the shm "
                                    "heap is host memory by design",
}
"""Files that spell ``torch.device("cpu")`` -> why (the checker cannot tell it from the job's device on the CPU)."""


def test_torch_device_cpu_is_spelled_only_where_allowed() -> None:
    sites = {s.rsplit(":", 1)[0] for s in literal_host_devices()}
    assert sites <= set(HOST_DEVICE_SPELLED), sites - set(HOST_DEVICE_SPELLED)


def test_threads_started_under_the_checker_are_checked() -> None:
    import threading

    planted = _planted("def planted():\n    return torch.ones(2)\n", "memory/planted.py")
    with device_discipline("cpu") as found:
        worker = threading.Thread(target=planted)
        worker.start()
        worker.join()
    assert [v.what for v in found] == ["torch.ones without device="]
