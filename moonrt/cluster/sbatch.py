"""``moonrt sbatch --nodes N --ntasks-per-node M [--config FILE] [--submit] [--output PATH] -- command ...``

Writes a SLURM batch script that runs ``command`` once per task under ``srun``; each task joins
the job through the SLURM path of :func:`moonrt.cluster.env.init_distributed` (rank =
``SLURM_PROCID``, world = ``SLURM_STEP_NUM_TASKS``, master = first node of the step, port from
the job and step ids). ``--submit`` hands the script to ``sbatch`` and prints the job id: without ``--output`` the
script goes to sbatch on stdin and is kept as ``./<job-name>-<job id>.sbatch`` once submitted (several submissions
from one directory each get their own; nothing is written when sbatch refuses one).

``--config FILE`` names the job's YAML config, read now with the schema ``moonrt train --config`` reads
(the job layer passes its loader, :mod:`moonrt.jobs.train.sbatch`: the same keys, the same checks, the same
messages), so mistakes surface before the job queues. Its ``parallel`` degrees must fill ``nodes x
ntasks_per_node`` ranks as ``moonrt train`` will (equal, or ``dp`` 1 and a divisor: dp is inferred). Its ``dist``
settings are the job's: ``dist.timeout_s`` and ``dist.rdzv_host``, when set, are what the script exports to
every task (``MOONRT_DIST_TIMEOUT``, ``MOONRT_RDZV_HOST``; the ranks read the same values from the config,
which wins there); ``--timeout`` / ``--rdzv-host`` fill what the config leaves ``null`` and must not contradict
what it sets (one line naming both). The command receives ``--config <absolute path>``.

``--gpus-per-node``, ``--account``, ``--qos``, ``--mem`` (SLURM sizes: ``64G``, ``500M``, ``0``) and raw
``--sbatch-line '#SBATCH --option[=value]'`` lines (repeatable; one value of shell-safe characters, not an option the
script writes itself: :data:`WRITTEN_OPTIONS`, nor an alias or abbreviation sbatch reads as one, ``--sig`` for
``--signal``: :func:`written_options`) add ``#SBATCH`` directives, all before the script's first command.
``--nodes`` x ``--ntasks-per-node`` is at most :data:`MAX_RANKS` (65,536) ranks.

The script is rendered by the pure function :func:`render_sbatch` from a :class:`SbatchJob`.
Every value is validated before it is written: the ``#SBATCH`` values (job name, partition, time
limit, log path) must consist of characters that need no shell quoting (letters, digits and
``_ @ % + = : , . / -``; no whitespace, quotes or newlines, so no value can start a new script
line), numbers must be finite, and everything bash executes (``cd`` target, command) is
shell-quoted. The time limit must be a SLURM time whose fields are in range (:func:`slurm_seconds`:
``99:99:99`` is refused), and with ``--requeue`` the signal lead must be shorter than it. A bad value
is one line naming the flag (CLI: exit 2). The script file is created exclusively: an existing file
(or symlink) there is refused unless ``--force``, which writes a new file and renames it over the old.

``--requeue [--signal-lead SECONDS]`` (preemption, :mod:`moonrt.cluster.preempt`): the script asks SLURM for
``--signal=B:USR1@SECONDS`` (SIGUSR1 to the batch shell that long before the time limit; ``scancel
--signal=USR1 --batch JOB`` sends it at any time) and ``--requeue``, appends to its log across runs, starts
the step in the background and traps SIGUSR1: the trap forwards it to ``srun``, which passes it on to every
task (measured on slurm-wlm 22.05: SIGUSR1 to ``srun`` reaches the tasks; SIGTERM to ``srun`` instead cancels
the step). When the step then exits with :data:`moonrt.cluster.preempt.PREEMPTED_EXIT` (75), or is killed
by a signal after the trap fired (``--kill-on-bad-exit`` ends the remaining tasks once the first one exits
75, so ``srun`` may report 143), the script runs ``scontrol requeue $SLURM_JOB_ID``; the next run continues
from the checkpoint. A ``moonrt train`` command gets ``--signal USR1`` and ``--resume-if-exists`` appended
(unless it names ``--signal`` / ``--resume`` itself) so that the first run starts fresh and a requeued one
resumes; any other command must stop on SIGUSR1 and exit 75 itself. (SLURM makes a requeued job eligible
again only after a delay, about two minutes on 22.05.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from moonrt.cluster.env import TIMEOUT_ENV
from moonrt.cluster.preempt import PREEMPTED_EXIT
from moonrt.cluster.store import RDZV_HOST_ENV
from moonrt.config import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, ConfigError, DistConfig, ParallelConfig, check, write_new

FLAGS = {"command": "command", "nodes": "--nodes", "ntasks_per_node": "--ntasks-per-node",
         "cpus_per_task": "--cpus-per-task", "job_name": "--job-name", "partition": "--partition", "time": "--time",
         "log": "--log", "workdir": "working directory", "timeout_s": "--timeout",
         "rdzv_host": "--rdzv-host", "requeue": "--requeue", "signal_lead_s": "--signal-lead",
         "gpus_per_node": "--gpus-per-node", "account": "--account", "qos": "--qos", "mem": "--mem",
         "sbatch_lines": "--sbatch-line"}
"""Each :class:`SbatchJob` field's name on the ``moonrt sbatch`` command line (for error messages)."""

_SAFE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)
"""Exactly the characters :func:`shlex.quote` leaves bare: such a value is one shell word as written."""
_PARTITION = re.compile(r"[\w.-]+(,[\w.-]+)*", re.ASCII)
_TIME = re.compile(r"(?P<d>\d{1,5})-(?P<h>\d{1,2})(?::(?P<m>\d{1,2})(?::(?P<s>\d{1,2}))?)?"
                   r"|(?P<a>\d{1,8})(?::(?P<b>\d{1,2})(?::(?P<c>\d{1,2}))?)?", re.ASCII)
_NAME = re.compile(r"[\w.-]+", re.ASCII)
"""An account or QOS name: letters, digits, '_', '.', '-'."""
_MEM = re.compile(r"(0|[1-9]\d{0,11})[KMGT]?", re.ASCII)
"""SLURM's ``--mem``: an integer (MB by default; 0: all of each node's memory), optionally with a K, M, G, T unit."""
_SBATCH_LINE = re.compile(r"#SBATCH --(?P<opt>[A-Za-z][A-Za-z0-9-]*)(?:(?P<sep>[= ])(?P<value>[\w@%+=:,./-]+))?",
                          re.ASCII)
"""A raw ``--sbatch-line``: ``#SBATCH --option`` with at most one value of shell-safe characters (:data:`_SAFE`),
joined by ``=`` or one space: no quotes, no whitespace inside, no newline, nothing ``sbatch`` or bash could read as
more than one option (a value after a space must not start with ``-``: after an option that takes no value, or an
optional one, sbatch would read it as an option: ``--hold --nodes=4``)."""
MAX_GPUS_PER_NODE = 1024
"""Largest ``--gpus-per-node``: a bound far above any node (8 to 16 GPUs), so that a typo is refused here."""
WRITTEN_OPTIONS = {"job-name": "--job-name", "nodes": "--nodes", "ntasks-per-node": "--ntasks-per-node",
                   "ntasks": "--nodes x --ntasks-per-node", "output": "--log", "partition": "--partition",
                   "time": "--time", "cpus-per-task": "--cpus-per-task", "signal": "--requeue", "requeue": "--requeue",
                   "open-mode": "--requeue", "gpus-per-node": "--gpus-per-node", "account": "--account",
                   "qos": "--qos", "mem": "--mem"}
"""``#SBATCH`` options the script writes itself (or that its ``srun`` line fixes) -> the ``moonrt sbatch`` flag that
sets them: a ``--sbatch-line`` naming one is refused (two values of one option, or a task count that contradicts the
rank layout), also under another name sbatch reads as one of them (:func:`written_options`)."""
SBATCH_ALIASES = {"tasks-per-node": "ntasks-per-node"}
"""sbatch's other long names of a written option (the same option in SLURM's table, ``src/common/slurm_opt.c``,
unchanged from 20.02 to 25.x)."""
SBATCH_EXACT_PREFIXES = frozenset({"gpus"})
"""sbatch options of their own whose names are proper prefixes of a written option's (``--gpus`` is not
``--gpus-per-node``): an exact name wins over an abbreviation in ``getopt_long`` (SLURM's table, as above)."""
MAX_RANKS = 65536
"""Largest ``--nodes`` x ``--ntasks-per-node``: 64 Ki ranks, far above any job moonrt runs (K3's report: thousands
of GPUs) and far below what would overflow SLURM's task counts, so that a typo (``--nodes 100000000``) is refused
here rather than queued."""
TIME_FORMATS = ("a SLURM time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (minutes and seconds < 60 after "
                "the first field, hours < 24 after a day part), 0 or UNLIMITED")


def slurm_seconds(value: str) -> int | None:
    """Seconds of a SLURM time limit (``--time``); ``None`` for no limit (``UNLIMITED``, ``INFINITE``, 0).

    Formats (sbatch(1)): minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
    days-hours:minutes:seconds. The first field is unbounded; minutes and seconds after it must be < 60, hours
    after a day part < 24 (SLURM itself would silently carry ``99:99:99`` over). ``ValueError`` otherwise.
    """
    if value in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"time limit {value!r}: not in a SLURM time format")
    f = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "d" in f:
        bounded = [f["h"] < 24, f.get("m", 0) < 60, f.get("s", 0) < 60]
        total = ((f["d"] * 24 + f["h"]) * 60 + f.get("m", 0)) * 60 + f.get("s", 0)
    elif "c" in f:  # hours:minutes:seconds
        bounded = [f["b"] < 60, f["c"] < 60]
        total = (f["a"] * 60 + f["b"]) * 60 + f["c"]
    else:  # minutes[:seconds]
        bounded = [f.get("b", 0) < 60]
        total = f["a"] * 60 + f.get("b", 0)
    if not all(bounded):
        raise ValueError(f"time limit {value!r}: a field out of range")
    return total or None


def written_options(name: str) -> list[str]:
    """The written options (keys of :data:`WRITTEN_OPTIONS`) that sbatch may read ``--name`` as: ``[name]`` itself,
    the option an alias names (:data:`SBATCH_ALIASES`), or every written option ``name`` abbreviates, since sbatch
    parses its options (``#SBATCH`` lines included) with ``getopt_long``, which takes any unambiguous prefix of a
    long option (``--sig`` for ``--signal``) and refuses an ambiguous one. Empty when ``name`` is none of them: an
    exact sbatch option (:data:`SBATCH_EXACT_PREFIXES`) or the prefix of no written name."""
    if name in WRITTEN_OPTIONS:
        return [name]
    if name in SBATCH_EXACT_PREFIXES:
        return []
    full = [SBATCH_ALIASES.get(f, f) for f in (*WRITTEN_OPTIONS, *SBATCH_ALIASES) if f.startswith(name)]
    return sorted(set(full), key=len)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(kw_only=True, slots=True)
class SbatchJob:
    """Everything that goes into one batch script."""

    command: list[str]
    """Program and arguments run on every task (the first word is resolved to an absolute path)."""
    nodes: int = 1
    ntasks_per_node: int = 1
    job_name: str = "moonrt"
    partition: str | None = None
    time: str | None = None
    """SLURM time limit, e.g. ``"01:00:00"``; ``None``: the partition's default."""
    cpus_per_task: int | None = None
    log: str = "moonrt-%j.out"
    """Job output file (``%j`` = job id), relative to ``workdir``."""
    workdir: str = "."
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Collective/rendezvous timeout of every task (``MOONRT_DIST_TIMEOUT``; a job config's ``dist.timeout_s``)."""
    rdzv_host: str | None = None
    """Address rank 0's rendezvous store binds (``MOONRT_RDZV_HOST``); ``None``: the first node's address."""
    requeue: bool = False
    """Preemption support: SIGUSR1 ahead of the time limit, forwarded to the step; requeue on exit code 75."""
    signal_lead_s: int = 120
    """With ``requeue``: seconds before the time limit at which SLURM sends SIGUSR1 (``--signal=B:USR1@...``)."""
    gpus_per_node: int | None = None
    """``#SBATCH --gpus-per-node``; ``None``: not written (the partition's default)."""
    account: str | None = None
    """``#SBATCH --account`` (charged account)."""
    qos: str | None = None
    """``#SBATCH --qos`` (quality of service)."""
    mem: str | None = None
    """``#SBATCH --mem`` per node, SLURM syntax: ``64G``, ``500M``, ``0`` (all of the node's memory)."""
    sbatch_lines: list[str] = dataclasses.field(default_factory=list)
    """Raw ``#SBATCH --option[=value]`` lines written after the others (:data:`_SBATCH_LINE`; not an option in
    :data:`WRITTEN_OPTIONS`)."""

    def validate(self, *, flags: bool = False) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its CLI flag when ``flags``)."""

        def name(field: str) -> str:
            return FLAGS[field] if flags else field

        check(bool(self.command) and all(isinstance(a, str) for a in self.command), name("command"), self.command,
              "a program (and its arguments) to run on every task")
        for field in ("nodes", "ntasks_per_node"):
            value = getattr(self, field)
            check(_is_int(value) and value >= 1, name(field), value, "an integer >= 1")
        if self.nodes * self.ntasks_per_node > MAX_RANKS:
            raise ConfigError(f"{name('nodes')} x {name('ntasks_per_node')} = {self.nodes} x {self.ntasks_per_node} = "
                              f"{self.nodes * self.ntasks_per_node} ranks: expected at most {MAX_RANKS} (MAX_RANKS)")
        check(self.cpus_per_task is None or (_is_int(self.cpus_per_task) and self.cpus_per_task >= 1),
              name("cpus_per_task"), self.cpus_per_task, "an integer >= 1")
        check(isinstance(self.job_name, str) and bool(re.fullmatch(r"[\w.-]+", self.job_name, re.ASCII)),
              name("job_name"), self.job_name, "letters, digits, '_', '.', '-'")
        if self.partition is not None:
            check(isinstance(self.partition, str) and bool(_PARTITION.fullmatch(self.partition)), name("partition"),
                  self.partition, "a partition name (or comma-separated names) of letters, digits, '_', '.', '-'")
        seconds = None
        if self.time is not None:
            try:
                seconds, valid = slurm_seconds(self.time), True
            except ValueError:
                valid = False
            check(valid, name("time"), self.time, TIME_FORMATS)
        check(isinstance(self.log, str) and bool(_SAFE.fullmatch(self.log)), name("log"), self.log,
              "a file path of letters, digits and '_ @ % + = : , . / -' (no spaces, quotes or control characters)")
        if self.rdzv_host is not None:
            check(isinstance(self.rdzv_host, str) and bool(re.fullmatch(r"[\w.:%-]+", self.rdzv_host, re.ASCII)),
                  name("rdzv_host"), self.rdzv_host, "an IP address or host name of rank 0's interface (0.0.0.0: all)")
        check(isinstance(self.workdir, str) and bool(self.workdir) and "\0" not in self.workdir, name("workdir"),
              self.workdir, "a directory path")
        check(isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0
              and self.timeout_s <= MAX_TIMEOUT_S, name("timeout_s"), self.timeout_s,
              f"a positive number of seconds <= {MAX_TIMEOUT_S:g} (a week, as DistConfig.timeout_s)")
        check(isinstance(self.requeue, bool), name("requeue"), self.requeue, "True or False")
        check(_is_int(self.signal_lead_s) and 1 <= self.signal_lead_s <= 65535, name("signal_lead_s"),
              self.signal_lead_s, "an integer number of seconds in [1, 65535] (SLURM's --signal range)")
        check(self.gpus_per_node is None or (_is_int(self.gpus_per_node)
                                             and 1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE),
              name("gpus_per_node"), self.gpus_per_node, f"an integer in [1, {MAX_GPUS_PER_NODE}] (MAX_GPUS_PER_NODE)")
        for field in ("account", "qos"):
            value = getattr(self, field)
            check(value is None or (isinstance(value, str) and bool(_NAME.fullmatch(value))), name(field), value,
                  "a SLURM name of letters, digits, '_', '.', '-'")
        check(self.mem is None or (isinstance(self.mem, str) and bool(_MEM.fullmatch(self.mem))), name("mem"),
              self.mem, "a SLURM memory size: an integer of MB, or with a unit K, M, G, T (64G, 500M; 0: all of the "
              "node's memory)")
        check(isinstance(self.sbatch_lines, (list, tuple)), name("sbatch_lines"), self.sbatch_lines, "a list of lines")
        for line in self.sbatch_lines:
            m = _SBATCH_LINE.fullmatch(line) if isinstance(line, str) else None
            check(m is not None, name("sbatch_lines"), line, "'#SBATCH --option' or '#SBATCH --option=value', the "
                  "value of letters, digits and '_ @ % + = : , . / -' (no spaces, quotes, newlines or shell "
                  "metacharacters)")
            opt = m.group("opt") if m else ""
            written = written_options(opt)
            check(not written, name("sbatch_lines"), line,
                  f"an option the script does not write itself (moonrt sbatch {WRITTEN_OPTIONS[written[0]]} sets it"
                  + ("" if written == [opt] else f"; sbatch reads --{opt} as --{' or --'.join(written)}") + ")"
                  if written else "")
            check(not (m and m.group("sep") == " " and m.group("value").startswith("-")), name("sbatch_lines"),
                  line, "a value joined with '=' when it starts with '-' (after a space, sbatch may read it as an "
                  "option of its own)")
        if self.requeue and seconds is not None:  # SLURM would signal before (or as) the job starts
            check(self.signal_lead_s < seconds, name("signal_lead_s"), self.signal_lead_s,
                  f"fewer seconds than the time limit {name('time')} = {self.time!r} ({seconds} s)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ntasks_per_node


def render_sbatch(job: SbatchJob) -> str:
    """The batch script text for ``job`` (validated first)."""
    job.validate()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(job.job_name)}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.ntasks_per_node}",
        f"#SBATCH --output={shlex.quote(job.log)}",
    ]
    # validate() admitted only values that shlex.quote leaves bare: quoting here is a second guard
    if job.partition:
        lines.append(f"#SBATCH --partition={shlex.quote(job.partition)}")
    if job.time:
        lines.append(f"#SBATCH --time={shlex.quote(job.time)}")
    if job.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.account:
        lines.append(f"#SBATCH --account={shlex.quote(job.account)}")
    if job.qos:
        lines.append(f"#SBATCH --qos={shlex.quote(job.qos)}")
    if job.mem:
        lines.append(f"#SBATCH --mem={job.mem}")
    if job.requeue:
        lines += [f"#SBATCH --signal=B:USR1@{job.signal_lead_s}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    lines += job.sbatch_lines  # validated: one '#SBATCH --option[=value]' each, after moonrt's own
    srun = f"srun --kill-on-bad-exit=1 --ntasks={job.world_size} --ntasks-per-node={job.ntasks_per_node} \\"
    lines += [
        "# written by `moonrt sbatch`: one task per rank; each joins through the SLURM path of",
        "# moonrt.cluster.env.init_distributed (SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_STEP_NODELIST).",
        "set -euo pipefail",
        f"cd {shlex.quote(job.workdir)}",
        f"export {TIMEOUT_ENV}={job.timeout_s:g}",
        *([f"export {RDZV_HOST_ENV}={shlex.quote(job.rdzv_host)}"] if job.rdzv_host else []),
        "export PYTHONUNBUFFERED=1",
    ]
    if not job.requeue:
        return "\n".join([*lines, srun, "    " + shlex.join(job.command), ""])
    lines += [
        "# --requeue: SIGUSR1 (SLURM, the lead time before the limit; or scancel --signal=USR1 --batch) reaches this",
        "# shell; the trap forwards it to srun, which passes it to every task: they finish their step, checkpoint",
        f"# and exit {PREEMPTED_EXIT}; the job is then requeued and the next run resumes from the checkpoint.",
        "preempted=0",
        "step=",
        "forward() {",
        "  preempted=1",
        '  echo "moonrt sbatch: SIGUSR1: forwarding it to the job step (srun pid ${step:-not started})"',
        '  if [ -n "$step" ]; then kill -USR1 "$step" 2>/dev/null || true; fi',
        "}",
        "trap forward USR1",
        srun,
        "    " + shlex.join(requeue_command(job.command)) + " &",
        "step=$!",
        'if [ "$preempted" = 1 ]; then kill -USR1 "$step" 2>/dev/null || true; fi',
        "while :; do  # wait returns early (> 128) when the trap runs: wait again while the step lives",
        '  rc=0; wait "$step" || rc=$?',
        '  kill -0 "$step" 2>/dev/null || break',
        "done",
        f'if [ "$rc" -eq {PREEMPTED_EXIT} ] || {{ [ "$preempted" = 1 ] && [ "$rc" -gt 128 ]; }}; then',
        '  echo "moonrt sbatch: job step stopped (exit $rc) after the stop signal: requeueing job $SLURM_JOB_ID'
        ' (restart ${SLURM_RESTART_COUNT:-0})"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def requeue_command(command: list[str]) -> list[str]:
    """``command``, with ``--signal USR1`` and ``--resume-if-exists`` appended when it runs ``moonrt train``
    (``.../moonrt train ...`` or ``python -m moonrt.cli train ...``) and names neither itself."""
    is_train = any(
        word == "train" and (os.path.basename(command[i - 1]) == "moonrt"
                             or (i >= 2 and command[i - 2] == "-m" and command[i - 1] in ("moonrt", "moonrt.cli")))
        for i, word in enumerate(command) if i >= 1
    )
    if not is_train:
        return list(command)
    extra = []
    if not any(a == "--signal" or a.startswith("--signal=") for a in command):
        extra += ["--signal", "USR1"]
    if not any(a in ("--resume", "--resume-if-exists") for a in command):
        extra.append("--resume-if-exists")
    return [*command, *extra]


def job_from_config(job: SbatchJob, config: Path, load: Callable[[Path], Any],
                    given: Collection[str] = (), config_args: Sequence[str] = ()) -> SbatchJob:
    """Check the job's YAML config against the allocation; take its ``dist`` settings; pass it to the command
    (see module doc).

    ``load``: the job layer's loader (``moonrt train``'s schema), returning a config with ``parallel``
    (:class:`ParallelConfig`) and ``dist`` (:class:`DistConfig`); its :class:`ConfigError` names the file and the
    field. ``given``: the fields of ``job`` the command line set (``timeout_s``, ``rdzv_host``): one that
    contradicts the config is an error (the config wins in every rank). ``config_args``: passed to the command after
    ``--config <path>`` (the job layer's ``--set`` overrides, which ``load`` has applied)."""
    cfg = load(config)
    parallel: ParallelConfig = cfg.parallel
    dist: DistConfig = cfg.dist
    world = job.world_size
    if parallel.world_size != world and not (parallel.dp == 1 and world % parallel.world_size == 0):
        raise ConfigError(
            f"{config}: parallel = dp {parallel.dp} x pp {parallel.pp} x ep {parallel.ep} x cp {parallel.cp} = "
            f"{parallel.world_size}: expected nodes {job.nodes} x ntasks_per_node {job.ntasks_per_node} = "
            f"{world} (or dp 1 and a divisor of it: dp is then inferred)"
        )
    changes: dict[str, Any] = {}
    for field in ("timeout_s", "rdzv_host"):
        value = getattr(dist, field)
        if value is None:
            continue
        if field in given and getattr(job, field) != value:
            raise ConfigError(f"{FLAGS[field]} = {getattr(job, field)!r}: expected the config's dist.{field} = "
                              f"{value!r} ({config}; the job config wins in every rank), or no {FLAGS[field]}")
        changes[field] = value
    command = [*job.command, "--config", str(config.resolve()), *config_args]
    return dataclasses.replace(job, command=command, **changes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-N", "--nodes", type=int, required=True, help="number of nodes (sbatch's -N)")
    parser.add_argument("--ntasks-per-node", type=int, required=True, help="ranks per node")
    parser.add_argument("--config", type=Path, default=None, help="job config YAML (checked, passed as --config)")
    parser.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    parser.add_argument("--output", type=Path, default=None,
                        help="where to write the script (default: stdout; with --submit: submitted from memory, "
                        "then kept as ./<job-name>-<job id>.sbatch, nothing written when sbatch refuses it); an "
                        "existing file is refused unless --force")
    parser.add_argument("--force", action="store_true", help="replace an existing script file")
    parser.add_argument("--job-name", default="moonrt", help="#SBATCH --job-name: the name squeue shows; also "
                        "names the log (<job-name>-%%j.out) and the kept script (default moonrt)")
    parser.add_argument("--partition", default=None, metavar="P", help="#SBATCH --partition: the partition (queue) "
                        "to run in (default: not written, the cluster's default partition)")
    parser.add_argument("--time", default=None, help="time limit, e.g. 01:00:00")
    parser.add_argument("--cpus-per-task", type=int, default=None, metavar="N", help="#SBATCH --cpus-per-task: CPU "
                        "cores per rank, for its threads and data loading (default: not written, SLURM's 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                        help=f"#SBATCH --gpus-per-node (1 to {MAX_GPUS_PER_NODE})")
    parser.add_argument("--account", default=None, metavar="A", help="#SBATCH --account: the account charged")
    parser.add_argument("--qos", default=None, metavar="Q", help="#SBATCH --qos: quality of service")
    parser.add_argument("--mem", default=None, metavar="SIZE", help="#SBATCH --mem per node, SLURM syntax: 64G, "
                        "500M, 0 (all of the node's memory)")
    parser.add_argument("--sbatch-line", action="append", default=[], metavar="LINE",
                        help="raw '#SBATCH --option[=value]' line written after moonrt's own (repeatable; one "
                        "shell-safe value, not an option the script writes itself), e.g. '#SBATCH --exclusive'")
    parser.add_argument("--log", default=None, help="job output file (default: <job-name>-%%j.out)")
    parser.add_argument("--timeout", type=float, default=None, help="collective timeout in seconds (default: the "
                        "config's dist.timeout_s, else 300)")
    parser.add_argument("--rdzv-host", default=None,
                        help="address of the interface rank 0's rendezvous store listens on (MOONRT_RDZV_HOST; "
                             "default: the config's dist.rdzv_host, else the address the first node's name resolves "
                             "to; 0.0.0.0: every interface)")
    parser.add_argument("--requeue", action="store_true",
                        help="preemption: SIGUSR1 --signal-lead seconds before the time limit, forwarded to the "
                        f"tasks; requeue the job when they stop with exit code {PREEMPTED_EXIT} (a moonrt train "
                        "command gets --signal USR1 --resume-if-exists)")
    parser.add_argument("--signal-lead", type=int, default=None,
                        help="with --requeue: seconds before the time limit at which SLURM sends SIGUSR1 (default 120)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments run on every task")


def run(args: argparse.Namespace, load_config: Callable[[Path], Any], config_args: Sequence[str] = ()) -> int:
    """``moonrt sbatch``; ``load_config`` reads ``--config`` (the job layer's schema: :func:`job_from_config`),
    ``config_args`` follow ``--config <path>`` on the command (the job layer's overrides; they need ``--config``)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if command:
        exe = shutil.which(command[0])
        command[0] = os.path.abspath(exe) if exe else command[0]
    try:
        job = SbatchJob(command=command, nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                        job_name=args.job_name, partition=args.partition, time=args.time,
                        cpus_per_task=args.cpus_per_task, log=args.log or f"{args.job_name}-%j.out",
                        workdir=os.getcwd(), timeout_s=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
                        rdzv_host=args.rdzv_host, requeue=args.requeue,
                        signal_lead_s=120 if args.signal_lead is None else args.signal_lead,
                        gpus_per_node=args.gpus_per_node, account=args.account, qos=args.qos, mem=args.mem,
                        sbatch_lines=list(args.sbatch_line))
        if args.signal_lead is not None and not args.requeue:
            raise ConfigError(f"--signal-lead = {args.signal_lead}: expected together with --requeue")
        job.validate(flags=True)
        if args.config is not None:
            given = [f for f, v in (("timeout_s", args.timeout), ("rdzv_host", args.rdzv_host)) if v is not None]
            job = job_from_config(job, args.config, load_config, given, config_args)
        text = render_sbatch(job)
    except ConfigError as exc:
        print(f"moonrt sbatch: {exc}", file=sys.stderr)
        return 2
    if args.submit and args.output is None:
        return submit_text(text, job.job_name)
    path = args.output
    if path is None:
        sys.stdout.write(text)
        return 0
    what = "--output" if args.output is not None else "script"
    try:
        write_new(path, text, force=args.force, mode=0o777)  # exclusive; --force: temp + rename
    except FileExistsError:
        print(f"moonrt sbatch: {what} = {str(path)!r}: already exists (give --force to replace it)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"moonrt sbatch: {what} = {str(path)!r}: cannot write ({exc.strerror})", file=sys.stderr)
        return 2
    print(f"moonrt sbatch: wrote {path} ({job.nodes} node(s) x {job.ntasks_per_node} task(s))", file=sys.stderr)
    if not args.submit:
        return 0
    return submit(path)


def _sbatch(args: list[str], what: str, script: str | None = None) -> str | int:
    """``sbatch --parsable ARGS`` (the script on stdin when ``script`` is given): the job id, or the exit code after
    one line naming ``what`` and sbatch's message."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print("moonrt sbatch: --submit needs the `sbatch` command, which is not on PATH", file=sys.stderr)
        return 2
    res = subprocess.run([sbatch, "--parsable", *args], input=script, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        print(f"moonrt sbatch: sbatch {what} failed (exit code {res.returncode}): {res.stderr.strip()}",
              file=sys.stderr)
        return res.returncode or 1
    return res.stdout.strip().split(";")[0]


def submit(path: Path) -> int:
    """``sbatch --parsable path``; print the job id. Non-zero (with sbatch's message) on failure."""
    job_id = _sbatch([str(path)], str(path))
    if isinstance(job_id, int):
        return job_id
    print(job_id)
    return 0


def submit_text(text: str, job_name: str) -> int:
    """Submit the script ``text`` from memory (sbatch reads it on stdin), then keep it as
    ``./<job_name>-<job id>.sbatch`` beside the job's log: every submission from one directory gets its own file, and
    a submission sbatch refuses writes nothing. Prints the job id."""
    job_id = _sbatch([], "(the script on stdin)", text)
    if isinstance(job_id, int):
        return job_id
    path = Path(f"{job_name}-{job_id}.sbatch")
    try:
        write_new(path, text, mode=0o777)
        print(f"moonrt sbatch: submitted job {job_id}; its script is {path}", file=sys.stderr)
    except OSError as exc:  # the job is submitted either way: the copy is a record, not its input
        print(f"moonrt sbatch: submitted job {job_id}; its script not kept: {str(path)!r}: "
              f"{exc.strerror or exc}", file=sys.stderr)
    print(job_id)
    return 0
