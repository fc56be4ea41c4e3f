"""The ``moonrt`` command line: one subcommand per job, each implemented in its own module.

Each entry of :data:`COMMANDS` names a module that defines ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand runs (``moonrt --help``
stays fast and does not import torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Keep sorted by the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("moonrt.train_cli", "train the K3 model (default: k3_tiny on the stdlib sources) -- the main job"),
    "launch": ("moonrt.cluster.launch", "run N local ranks of a command (or --selftest), like torchrun"),
    "selftest": ("moonrt.cluster.selftest", "check and time the job's communication: collectives, MoonEP, KCP, remote"),
    "sbatch": ("moonrt.cluster.sbatch", "write (and optionally submit) a SLURM batch script for a job"),
    "ep-sim": ("moonrt.scheduler.sim", "simulate expert placement (MoonEP, EPLB, none) on a routing workload"),
    "mem-plan": ("moonrt.mem_plan", "per-rank memory model and activation-policy plan for a budget (ILP)"),
    "pp-plan": ("moonrt.pp_plan", "pipeline schedule (bubble, peak live) and AttnRes blocks per hop, naive vs cached"),
    "checkpoint": ("moonrt.checkpoint_cli", "inspect (info), export (safetensors), convert moonrt train checkpoints"),
}


def build_parser() -> argparse.ArgumentParser:
    from moonrt import __version__

    parser = argparse.ArgumentParser(
        prog="moonrt", description="moonrt: Kimi K3 training infrastructure on torch.distributed."
    )
    parser.add_argument("--version", action="version", version=f"moonrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help / usage errors
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"moonrt {name}", description=COMMANDS[name][1])
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
