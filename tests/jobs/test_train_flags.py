"""One spelling per train knob (issue 46 item 5), in the manner of torchtitan's ``test_no_new_cli_options``: the
``moonrt train`` parser holds exactly the flags generated from the two tables of :mod:`moonrt.jobs.train.flags`
(a flag added by hand fails), the table holds exactly the flags of today (a new flag is a deliberate row here too;
every other knob is ``--set``), every alias names an existing config field and reads its value as that field's
type (the same value ``--set`` gives), a malformed value is one line naming the field, and ``--help`` lists every
config field by section without importing torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moonrt.cli import main as cli_main
from moonrt.config.schema import _convert  # the schema's per-field type check (what --config and --set go through)
from moonrt.jobs.train import cli as train_cli
from moonrt.jobs.train.flags import (
    ALIASES,
    RUN_FLAGS,
    Alias,
    add_arguments,
    field_of,
    flag_kind,
    flag_values,
    sections,
)
from moonrt.jobs.train.overrides import parse_set

ROOT = Path(__file__).resolve().parents[2]

TODAY = {
    "--async-save", "--attn-res-comm", "--batch-size", "--checkpoint-every", "--config", "--corpus", "--cp",
    "--deterministic", "--device", "--dist-timeout", "--dtype", "--eos-id", "--ep", "--eval-every", "--eval-windows",
    "--gc-interval", "--grad-accum", "--init-from", "--keep-every", "--keep-latest", "--log-every", "--lr",
    "--memory-policy", "--metrics", "--microbatches", "--model", "--no-progress", "--optimizer", "--out",
    "--pack-documents", "--peak-tflops", "--pp", "--profile-ranks", "--profile-steps", "--qat", "--qat-block",
    "--reduce-dtype", "--resume", "--resume-allow-changes", "--resume-if-exists", "--routing-trace", "--schedule",
    "--seed", "--seq-len", "--set", "--signal", "--steps", "--tensorboard", "--threads", "--token-dtype",
    "--tokenizer", "--until", "--vpp", "--zero",
}
"""Every ``moonrt train`` flag (54; README, docs, tests and benchmarks use them). A knob without a flag here is set
with ``--set section.field=VALUE``; a new flag is a row of ``ALIASES`` (or ``RUN_FLAGS``) and a word here."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moonrt train")
    train_cli.add_arguments(parser)
    return parser


def _not_generated(parser: argparse.ArgumentParser) -> set[str]:
    """The parser's flags that no table row generates (argparse's own ``-h/--help`` aside)."""
    tables = {a.flag for a in ALIASES} | {r.flag for r in RUN_FLAGS} | {"-h", "--help"}
    return {o for action in parser._actions for o in action.option_strings} - tables


def test_the_parser_holds_only_generated_flags() -> None:
    parser = _parser()
    assert _not_generated(parser) == set()
    generated = {o for action in parser._actions for o in action.option_strings} - {"-h", "--help"}
    assert generated == {a.flag for a in ALIASES} | {r.flag for r in RUN_FLAGS}
    dests = [a.dest for a in parser._actions]
    assert len(dests) == len(set(dests)), dests
    parser.add_argument("--warmup", type=int)  # what a hand-written flag looks like to the check above
    assert _not_generated(parser) == {"--warmup"}


def test_no_new_cli_options() -> None:
    flags = [a.flag for a in ALIASES] + [r.flag for r in RUN_FLAGS]
    assert len(flags) == len(set(flags))
    assert set(flags) == TODAY, ("added: " + str(sorted(set(flags) - TODAY)) + "; removed: "
                                 + str(sorted(TODAY - set(flags))) + " (set a new knob with --set section.field=VALUE)")


def test_one_alias_per_field_and_no_alias_for_a_non_field() -> None:
    fields = [a.field for a in ALIASES]
    assert len(fields) == len(set(fields)), sorted(f for f in fields if fields.count(f) > 1)
    for a in ALIASES:
        field_of(a.path)  # KeyError for a path that is no field
    with pytest.raises(KeyError, match="OptimConfig has no field 'warmup'"):
        field_of(("optim", "warmup"))
    with pytest.raises(KeyError, match="optim.lr is a field, not a section"):
        field_of(("optim", "lr", "x"))
    with pytest.raises(TypeError, match="has no flag form"):  # moe, model_config: --set only
        flag_kind(field_of(("moe",))[2])


_TEXT = {"int": "3", "float": "0.5", "ints": "0,3"}


@pytest.mark.parametrize("alias", ALIASES, ids=lambda a: a.flag)
def test_every_alias_reads_its_fields_type_as_set_does(alias: Alias) -> None:
    """``FLAG TEXT`` and ``--set FIELD=TEXT`` name the same field with the same value, which the schema's type check
    of that field returns unchanged (no flag converts to another type than its field's)."""
    _cls, _f, hint = field_of(alias.path)
    kind, words = flag_kind(hint)
    if kind == "switch":
        argv, set_text = [alias.flag], "true"
    else:
        text = words[-1] if words else _TEXT.get(kind, "x")
        argv, set_text = [alias.flag, text], "[0, 3]" if kind == "ints" else text
    got = flag_values(_parser().parse_args(argv))
    assert list(got) == [alias.path]
    flag, value = got[alias.path]
    assert flag == alias.flag
    o = parse_set(f"{alias.field}={set_text}")
    assert o.path == alias.path
    assert value == o.value and type(value) is type(o.value), (value, o.value)
    assert _convert(hint, value, alias.field) == value


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "abc"], "optim.steps (--steps) = 'abc': expected an integer"),
    (["--lr", "fast"], "optim.lr (--lr) = 'fast': expected a number"),
    (["--dist-timeout", "1m"], "dist.timeout_s (--dist-timeout) = '1m': expected a number"),
    (["--profile-ranks", "0,x"], "log.profile_ranks (--profile-ranks) = '0,x': expected comma-separated integers"),
    (["--device", "gpu"], "device (--device) = 'gpu': expected one of 'auto', 'cpu', 'cuda'"),
])
def test_a_bad_value_is_one_line_naming_the_field_and_flag(argv: list[str], message: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Malformed text (read as the field's type) and a word a Literal field does not take are both the schema's one
    line: field, flag, value, what was expected; exit 2."""
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"moonrt train: error: {message}"), err


def test_flags_and_set_give_one_job() -> None:
    argv = ["--steps", "7", "--ep", "2", "--dtype", "bf16", "--pack-documents", "--profile-ranks", "0,3",
            "--signal", "USR1", "--out", "o", "--dist-timeout", "30"]
    sets = ["optim.steps=7", "parallel.ep=2", "precision.compute=bf16", "data.pack_documents=true",
            "log.profile_ranks=[0, 3]", "stop_signal=USR1", "out_dir=o", "dist.timeout_s=30"]
    by_flags = train_cli.job_from_args(_parser().parse_args(argv))
    by_set = train_cli.job_from_args(_parser().parse_args([w for s in sets for w in ("--set", s)]))
    assert dataclasses.asdict(by_flags) == dataclasses.asdict(by_set)
    assert (by_flags.optim.steps, by_flags.parallel.ep, by_flags.log.profile_ranks) == (7, 2, [0, 3])


def test_help_lists_every_field_by_section_and_imports_no_torch() -> None:
    """``moonrt train --help`` in a fresh interpreter: every config field appears in its section, as an alias's
    ``(field; default ...)`` or in the section's ``--set`` list, never both; no torch, numba, triton or fla is imported
    (numpy is: the job config's data module imports it, as before this table)."""
    code = ("import json, sys\n"
            "from moonrt.cli import main\n"
            "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numba', 'triton', 'fla'))\n"
            "print(json.dumps(heavy))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    text, heavy = r.stdout.rsplit("\n", 2)[0], json.loads(r.stdout.splitlines()[-1])
    assert heavy == [], heavy
    flat = " ".join(text.split())
    for section, (cls, title) in sections().items():
        assert f"\n{title}:" in text, title
        description = " ".join(text.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0].split())
        by_set = description.split(" for KEY in: ", 1)[1].split(", ") if " for KEY in: " in description else []
        for f in dataclasses.fields(cls):
            if section == "job" and f.name in sections():
                continue  # a section: its own group
            field = f.name if section == "job" else f"{section}.{f.name}"
            aliased = any(a.field == field for a in ALIASES)
            assert ((f"({field};" in flat or f"({field})" in flat) if aliased else f.name in by_set), field
            assert not (aliased and f.name in by_set), field
    for flag in TODAY:
        assert flag in flat, flag


def test_add_arguments_is_the_tables() -> None:
    """The job module's add_arguments is the generator's (moonrt.cli calls the job module's)."""
    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    train_cli.add_arguments(a)
    add_arguments(b)
    assert [x.option_strings for x in a._actions] == [x.option_strings for x in b._actions]


def test_every_flag_the_docs_give_moonrt_train_is_accepted() -> None:
    """The README's and docs' ``moonrt train`` commands keep running: each ``--flag`` after ``moonrt train`` on a line
    (up to the end of its code span) is one the parser takes."""
    known = {o for action in _parser()._actions for o in action.option_strings}
    used: dict[str, str] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for command in re.findall(r"moonrt train[^`\"'|\n]*", path.read_text()):
            for flag in re.findall(r"(?<!\S)(--[a-z][a-z-]*)", command):
                used.setdefault(flag, path.name)
    assert len(used) >= 10, used  # the docs do use the flags
    assert {f: where for f, where in used.items() if f not in known} == {}
