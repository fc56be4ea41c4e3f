"""``moonrt selftest``: verify moonrt's communication on real ranks, then measure it on this interconnect.

Runs under any launcher (``moonrt launch -n 4 --selftest``, ``torchrun``, ``srun``, ``mpiexec``;
alone it is a 1-rank job): joins the job with :func:`moonrt.cluster.env.init_distributed`, then runs
each suite of ``--suite`` (default: every suite the world size allows) on every rank at once. Each
suite first **checks** its results against a reference on every rank, then **measures** and rank 0
prints a table (DeepEP's ``tests/test_intranode.py`` habit):

- ``collectives`` (:mod:`.selftest_collectives`): all_reduce, all_to_all, all_gather, a send/recv
  ring; exact checks; time, algbw and busbw per message size (nccl-tests conventions);
- ``ep`` (:mod:`.selftest_ep`): MoonEP dispatch -> expert -> combine beside the plain all-to-all at
  several shapes and routing skews, outputs and gradients vs the pure-PyTorch MoE reference;
- ``kcp`` (:mod:`.selftest_kcp`): context-parallel KDA forward + backward vs the single-rank
  chunked form on the gathered input; bytes and time per layer;
- ``remote`` (:mod:`.selftest_remote`, >= 2 ranks): the activation manager's remote store round trip;
- ``transport`` (:mod:`moonrt.jobs.selftest.transport`): the transport seam's backends (collectives, and the
  shm / cuda heap when the ranks are on one host): put/get/signal/barrier and the heap all-to-all vs the
  collectives' bitwise, then all-to-all time and bandwidth per backend;
- ``pp`` (:mod:`.selftest_pp`, >= 2 ranks as one pipeline): the pipeline executor's hops between
  neighbours (exact payloads, time, bandwidth), cached vs naive AttnRes block counts per hop against
  the hop plan with exact received blocks, and 1F1B / interleaved end to end vs the single-rank
  float64 loss and gradients (a stand-in model: the runtime does not import moonrt.models.k3.model).

``--report PATH``: rank 0 writes JSON with the environment (backend, device, world size, ranks per
node, torch version), every rank's checks (and the raw collective outputs, so a caller can verify
them independently), every measurement and the suites skipped with their reason. ``--report`` and
``--profile-out`` files are created exclusively: an existing path is refused before the job starts (one
line, exit 2) unless ``--force``, which writes a new file and renames it over the old one. Exit code 0 only
when every check passed on every rank (1 otherwise; 2 for bad arguments). A failure is printed
as ``<suite>/<case>/<check> on rank <r>``.

A suite that cannot run on the job (``pp``/``remote`` on one rank; ``ep`` when no ``--ep-shapes`` expert count is
a multiple of the world size) is never a pass: rank 0 prints ``moonrt selftest <suite>: SKIPPED: <reason>`` and
the summary ends with ``; skipped: <suite> (<reason>)`` (EP shapes skipped beside others that ran too). When
nothing at all could be checked, the job exits :data:`NOTHING_CHECKED` (2) with one line on stderr
(``moonrt selftest: nothing could be checked on N ranks: every requested suite was skipped: ...``), and the
report says ``"passed": false`` with ``"checks": 0``.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from pathlib import Path
from types import ModuleType

from moonrt.config import write_new
from moonrt.jobs.selftest.collectives import (  # noqa: F401 (the module's public names, kept here)
    BUS_FACTOR,
    DEFAULT_SIZES,
    OPS,
    _sizes,
    check_collectives,
    fit_link,
    format_table,
    gemm_tflops,
    local_profile,
    measure,
    measure_local_profile,
)

SUITES = ("collectives", "ep", "kcp", "pp", "remote", "transport")
UNAVAILABLE: dict[str, str] = {}
"""Suites that never run today, with the reason printed and reported."""
MIN_WORLD = {"pp": 2, "remote": 2}
NOTHING_CHECKED = 2
"""Exit code when every requested suite was skipped (or ran no check): nothing could be checked on this job."""
FIRST = ("rows", "balance", "payload", "blocks_exact")
"""Checks of the data movement itself, listed before the checks their failure propagates to."""


def suite_list(text: str) -> tuple[str, ...]:
    """``"ep,kcp"`` -> suite names in the order given (argparse type); ``all`` = every suite."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return SUITES
    bad = [n for n in names if n not in SUITES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"suite {bad[0] if bad else text!r}: expected a comma-separated "
                                         f"subset of {', '.join(SUITES)} (or all)")
    return tuple(dict.fromkeys(names))


def _modules() -> dict[str, ModuleType]:
    from moonrt.jobs.selftest import collectives as selftest_collectives
    from moonrt.jobs.selftest import ep as selftest_ep
    from moonrt.jobs.selftest import kcp as selftest_kcp
    from moonrt.jobs.selftest import pp as selftest_pp
    from moonrt.jobs.selftest import remote as selftest_remote
    from moonrt.jobs.selftest import transport as selftest_transport

    return {"collectives": selftest_collectives, "ep": selftest_ep, "kcp": selftest_kcp, "pp": selftest_pp,
            "remote": selftest_remote, "transport": selftest_transport}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", type=suite_list, default=None,
                        help=f"comma-separated suites of {', '.join(SUITES)} (default: all the world size allows)")
    parser.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                        help="collectives: message sizes in bytes per rank, comma-separated, K/M suffixes "
                             "(default 4K,64K,1M,4M)")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed iterations per measurement (default 5, after 1 warm-up)")
    parser.add_argument("--report", type=Path, default=None,
                        help="rank 0 writes a JSON report here (a new file; an existing one only with --force)")
    parser.add_argument("--profile-out", type=Path, default=None,
                        help="rank 0 also runs a GEMM micro-benchmark and writes a hardware profile YAML for "
                             "`moonrt ep-sim --hardware` (all_to_all rows fitted to latency + bytes / bandwidth; "
                             "needs the collectives suite; a new file; an existing one only with --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing --report / --profile-out file")
    from moonrt.jobs.selftest import ep as selftest_ep
    from moonrt.jobs.selftest import kcp as selftest_kcp
    from moonrt.jobs.selftest import pp as selftest_pp
    from moonrt.jobs.selftest import remote as selftest_remote
    from moonrt.jobs.selftest import transport as selftest_transport

    for module in (selftest_ep, selftest_kcp, selftest_pp, selftest_remote, selftest_transport):
        module.add_arguments(parser)


def plan_suites(requested: tuple[str, ...] | None, world: int) -> tuple[list[str], dict[str, str]]:
    """``(to run, skipped -> reason)`` for ``requested`` (None: every suite) on ``world`` ranks."""
    run, skipped = [], {}
    for name in requested or SUITES:
        if name in UNAVAILABLE:
            skipped[name] = UNAVAILABLE[name]
        elif world < MIN_WORLD.get(name, 1):
            skipped[name] = f"needs >= {MIN_WORLD[name]} ranks, the job has {world}"
        else:
            run.append(name)
    return run, skipped


def environment(rdzv: object, rank: int, world: int) -> dict:
    """What the report records about where it ran (gathered from every rank: hosts, ranks per node)."""
    import torch
    import torch.distributed as dist

    from moonrt import __version__
    from moonrt.jobs.selftest.common import device

    dev = device()
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    per_node: dict[str, int] = {}
    for h in hosts:
        per_node[h] = per_node.get(h, 0) + 1
    counts = sorted(set(per_node.values()))
    return {"backend": dist.get_backend(), "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "world_size": world, "nodes": len(per_node),
            "ranks_per_node": counts[0] if len(counts) == 1 else per_node, "hosts": hosts,
            "launcher": getattr(rdzv, "source", "?"), "torch_version": torch.__version__,
            "moonrt_version": __version__, "python_version": platform.python_version(),
            "torch_threads": torch.get_num_threads()}


def check_output_path(path: Path, flag: str, force: bool) -> None:
    """Raise ``ValueError`` (one line naming ``flag``) unless rank 0 can create ``path``: not a directory, its
    directory exists, and nothing is there yet unless ``force``."""
    where = f"{flag} = {str(path)!r}"
    if path.is_dir():
        raise ValueError(f"{where}: is a directory: expected a file path")
    if (path.exists() or path.is_symlink()) and not force:
        raise ValueError(f"{where}: already exists (give --force to replace it)")
    if not path.absolute().parent.is_dir():
        raise ValueError(f"{where}: its directory {str(path.absolute().parent)!r} does not exist")


def _failure_text(name: str, rank: int, detail: dict) -> str:
    extra = {k: v for k, v in detail.items() if k != "ok"}
    shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
    return f"{name} on rank {rank}" + (f" ({shown})" if shown else "")


def _write(path: Path, flag: str, text: str, force: bool) -> bool:
    """:func:`moonrt.config.write_new`, an error reported in one line (False) instead of raised: the run's results
    stand, and rank 0 must still reach the final barrier."""
    try:
        write_new(path, text, force=force)
    except FileExistsError:
        print(f"moonrt selftest: {flag} = {str(path)!r}: already exists (created during the run; give --force to "
              "replace it)", file=sys.stderr, flush=True)
        return False
    except OSError as exc:
        print(f"moonrt selftest: {flag} = {str(path)!r}: cannot write ({exc.strerror})", file=sys.stderr, flush=True)
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Entry points


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from moonrt.cluster.detect import detect_rendezvous, launcher_name
    from moonrt.cluster.env import init_distributed, shutdown_distributed
    from moonrt.jobs.selftest.ep import corruption, validate

    try:  # argument combinations and the test hook, before joining (every rank exits 2 alike)
        validate(args)
        corruption()
        if args.iters < 1:
            raise ValueError(f"--iters {args.iters}: expected an integer >= 1")
        if args.profile_out is not None and args.suite is not None and "collectives" not in args.suite:
            raise ValueError(f"--profile-out {args.profile_out}: expected the collectives suite in --suite "
                             f"(got {','.join(args.suite)})")
        try:  # only rank 0 writes: on other nodes the path may not exist, or exist as another file
            writer = detect_rendezvous().rank == 0
        except ValueError:
            writer = True  # init_distributed below names the launcher variables at fault
        for path, flag in ((args.report, "--report"), (args.profile_out, "--profile-out")):
            if writer and path is not None:
                check_output_path(path, flag, args.force)
    except ValueError as exc:
        print(f"moonrt selftest: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    try:
        rdzv = init_distributed()
    except ValueError as exc:  # launcher environment incomplete or malformed (ConfigError included)
        print(f"moonrt selftest: {exc}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        t_start = time.perf_counter()
        to_run, skipped = plan_suites(args.suite, world)
        env = environment(rdzv, rank, world)
        if rank == 0:
            print(f"moonrt selftest: {world} ranks via {launcher_name(rdzv)}, backend {dist.get_backend()}, "
                  f"{env['nodes']} node(s), device {env['device']}; suites {', '.join(to_run) or 'none'}", flush=True)
            for n, why in skipped.items():
                print(f"moonrt selftest {n}: SKIPPED: {why}", flush=True)
        modules = _modules()
        ranks: list[dict] = [{"source": None, "local_rank": None, "checks": {}} for _ in range(world)]
        suites: dict[str, dict] = {n: {"status": "skipped", "reason": why} for n, why in skipped.items()}
        failures: list[str] = []
        n_checks = n_rows = 0
        for name in to_run:
            t0 = time.perf_counter()
            res = modules[name].run_suite(args, rank, world)
            mine = {"source": rdzv.source, "local_rank": rdzv.local_rank, "checks": res.checks}
            if name == "collectives":
                mine.update(ok=res.extra["ok"], outputs=res.extra["outputs"])
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            bad = [(r, c, d) for r, g in enumerate(gathered) for c, d in g["checks"].items() if not d["ok"]]
            bad.sort(key=lambda b: (b[1].rsplit("/", 1)[-1] not in FIRST, b[1], b[0]))  # data movement first
            total = sum(len(g["checks"]) for g in gathered)
            for r, g in enumerate(gathered):
                ranks[r]["source"], ranks[r]["local_rank"] = g["source"], g["local_rank"]
                ranks[r]["checks"].update(g["checks"])
                if name == "collectives":
                    ranks[r].update(ok=g["ok"], outputs=g["outputs"])
            if not total:  # no case of the suite fits this job (ep: no shape's E divides the world size)
                why = res.extra.get("skip_reason") or f"no case fits {world} ranks"
                suites[name] = {"status": "skipped", "reason": why}
                skipped[name] = why
                if rank == 0:
                    print(f"moonrt selftest {name}: SKIPPED: {why}", flush=True)
                continue
            for case in res.extra.get("skipped", ()):  # cases that did not fit (ep: a shape), the others ran
                skipped[f"{name} {case.split(':', 1)[0]}"] = case.split(": ", 1)[-1]
            lines = [_failure_text(c, r, d) for r, c, d in bad]
            failures += lines
            n_checks, n_rows = n_checks + total, n_rows + len(res.rows)
            suites[name] = {"status": "ran", "passed": not bad, "checks": total, "failed": lines,
                            "rows": res.rows, "seconds": time.perf_counter() - t0, "table": res.table,
                            **{k: v for k, v in res.extra.items() if k not in ("ok", "outputs")}}
            if rank == 0:
                print(res.table, flush=True)
                verdict = "all passed" if not bad else f"FAILED {len(bad)}: " + "; ".join(lines[:8]) + (
                    f"; ... and {len(bad) - 8} more" if len(bad) > 8 else "")
                print(f"moonrt selftest {name}: {total} checks on {world} ranks: {verdict} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
                if bad:
                    print(f"moonrt selftest {name}: FAILED {lines[0]}", file=sys.stderr, flush=True)
        checked = n_checks > 0  # a suite that cannot run on this job is no pass: with nothing checked, exit 2
        passed = checked and not failures
        written = True
        if rank == 0:
            skip = "; skipped: " + ", ".join(f"{n} ({why})" for n, why in skipped.items()) if skipped else ""
            if not checked:
                print(f"moonrt selftest: NOTHING CHECKED: {world} ranks, 0 checks{skip}", flush=True)
                print(f"moonrt selftest: nothing could be checked on {world} ranks: every requested suite was "
                      f"skipped{skip[len('; skipped'):]}", file=sys.stderr, flush=True)
            else:
                print(f"moonrt selftest: {'PASS' if passed else 'FAIL'}: {world} ranks, {n_checks} checks"
                      f"{'' if passed else f' ({len(failures)} failed)'}, {n_rows} measurements in "
                      f"{time.perf_counter() - t_start:.1f} s{skip}", flush=True)
            if args.report is not None:
                coll = suites.get("collectives", {})
                report = {"world_size": world, "backend": dist.get_backend(), "passed": passed, "checks": n_checks,
                          "skipped": skipped, "env": env, "suites": suites, "failures": failures, "ranks": ranks,
                          "bandwidth": coll.get("rows", [])}
                written = _write(args.report, "--report", json.dumps(report, indent=1, default=str), args.force)
            if args.profile_out is not None and "collectives" in suites and suites["collectives"]["status"] == "ran":
                import yaml

                prof = local_profile(suites["collectives"]["rows"], world, gemm_tflops(), dist.get_backend())
                if _write(args.profile_out, "--profile-out", yaml.safe_dump(prof, sort_keys=False), args.force):
                    print(f"moonrt selftest: wrote hardware profile {args.profile_out} (all_to_all "
                          f"{prof['intra_node']['bandwidth_GBps']:.3f} GB/s + "
                          f"{prof['intra_node']['latency_us']:.0f} us, GEMM {prof['gemm_tflops'] * 1e3:.1f} GFLOP/s)",
                          flush=True)
                else:
                    written = False
        dist.barrier()  # no rank tears its process group down while another still uses it (rank 0's report)
        if failures:
            return 1
        if not checked:
            return NOTHING_CHECKED
        return 0 if written else 2  # 2: the output file was refused or could not be written
    finally:
        # the suites leave objects that hold the group in reference cycles (the pp suite's executors hook their own
        # bound methods: _traced, _corrupt): shutdown_distributed collects them before destroying it
        shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moonrt.jobs.selftest", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
