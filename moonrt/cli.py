"""The ``moonrt`` command line: one subcommand per job, each implemented in its own module.

Each entry of :data:`COMMANDS` names a module that defines ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand runs (``moonrt --help``
stays fast and does not import torch). ``moonrt train`` handles its stop signals from before that import
(:func:`moonrt.cluster.preempt.arm_early`): a stop signal while torch loads stops the job at its starting step.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys
from typing import NoReturn

# name -> (module, one-line help). Keep sorted by the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("moonrt.jobs.train.cli", "train the K3 model (default: k3_tiny on the stdlib sources) -- the main job"),
    "launch": ("moonrt.cluster.launch", "run N local ranks of a command (or --selftest), like torchrun"),
    "selftest": ("moonrt.jobs.selftest.cli",
                 "check and time the job's communication: collectives, MoonEP, KCP, remote"),
    "sbatch": ("moonrt.jobs.train.sbatch", "write (and optionally submit) a SLURM batch script for a job"),
    "ep-sim": ("moonrt.jobs.ep_sim", "simulate expert placement (MoonEP, EPLB, none) on a routing workload"),
    "mem-plan": ("moonrt.jobs.mem_plan", "per-rank memory model and activation-policy plan for a budget (ILP)"),
    "pp-plan": ("moonrt.jobs.pp_plan",
                "pipeline schedule (bubble, peak live) and AttnRes blocks per hop, naive vs cached"),
    "data": ("moonrt.jobs.data_build", "build a Megatron indexed dataset (.bin/.idx) from text with a tokenizer"),
    "checkpoint": ("moonrt.jobs.checkpoint.cli",
                   "inspect (info), export (safetensors), convert moonrt train checkpoints"),
}


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, exit 2: ``PROG: error: MESSAGE`` and where to find
    the flags, instead of argparse's usage block (21 lines for ``moonrt train``) above it; an unknown flag names the
    closest known one (:func:`difflib.get_close_matches`)."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            unknown = message[len(prefix):].split()
            flags = [a for a in unknown if a.startswith("-")]
            first = (flags or unknown)[0]
            known = [o for a in self._actions for o in a.option_strings]
            close = difflib.get_close_matches(first.partition("=")[0], known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            more = f"; also unrecognized: {' '.join(flags[1:])}" if len(flags) > 1 else ""
            message = f"unrecognized argument {first}{hint}{more}"
        self.exit(2, f"{self.prog}: error: {message}; {self.prog} --help lists the flags\n")


def build_parser() -> argparse.ArgumentParser:
    from moonrt import __version__

    parser = OneLineParser(
        prog="moonrt", description="moonrt: Kimi K3 training infrastructure on torch.distributed."
    )
    parser.add_argument("--version", action="version", version=f"moonrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _stop_signal_arg(argv: list[str]) -> str | None:
    """The stop signal a ``moonrt train`` command line names, found without parsing it: ``--signal`` (the last one,
    as argparse takes it), else the last ``--set stop_signal=NAME``, else the ``stop_signal`` of its ``--config``
    file (the job config's precedence); None when none names one. Bad values are the real parse's to report."""
    found, config, setting = None, None, None
    for i, arg in enumerate(argv):
        for flag in ("--signal", "--config", "--set"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            else:
                continue
            if flag == "--signal":
                found = value
            elif flag == "--config":
                config = value
            elif value.partition("=")[0].strip() == "stop_signal":
                setting = value.partition("=")[2].strip().strip("'\"")
    found = found if found is not None else setting
    if found is None and config is not None and os.path.isfile(config):
        from moonrt.config import ConfigError, read_yaml

        with contextlib.suppress(ConfigError):
            raw = read_yaml(config)
            found = raw.get("stop_signal") if isinstance(raw, dict) else None
    return found if isinstance(found, str) else None


def _arm_stop_signals(argv: list[str]) -> None:
    """``moonrt train``: record a stop signal (SIGTERM, SIGINT, ``--signal``) that arrives before the job's own
    handlers are installed (:func:`moonrt.cluster.preempt.arm_early`; this imports no torch)."""
    from moonrt.cluster.preempt import arm_early, signal_from_name

    signals = ["SIGTERM", "SIGINT"]
    name = _stop_signal_arg(argv)
    if name is not None:
        with contextlib.suppress(ValueError):
            signals.append(signal_from_name(name).name)
    arm_early(signal_from_name(s) for s in signals)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"moonrt: error: unknown command {argv[0]!r}{hint}; expected one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help / usage errors
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    from moonrt.cluster.lifeline import die_with_agent

    die_with_agent()  # a torchrun worker dies with torchrun's agent, bound before torch loads (lifeline module doc)
    if name != "train":
        return _run(name, rest)
    from moonrt.cluster.preempt import Aborted, disarm_early

    _arm_stop_signals(rest)
    try:
        return _run(name, rest)
    except Aborted as exc:  # a second stop signal before the job's own handlers took over
        print(f"moonrt {name}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        disarm_early()  # the handlers from before (a job that ran took them over already)


def _run(name: str, rest: list[str]) -> int:
    module = importlib.import_module(COMMANDS[name][0])
    sub = OneLineParser(prog=f"moonrt {name}", description=COMMANDS[name][1])
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    if name == "checkpoint":  # its tools rebuild a checkpoint's model with train's builder (it never imports train)
        from moonrt.jobs.train.resume import BUILDER

        return int(module.run(args, BUILDER) or 0)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
