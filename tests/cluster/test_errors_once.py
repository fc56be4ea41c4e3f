"""Errors printed once (issue 49 item 6): a one-line error every rank finds (a config error) is echoed once by
``moonrt launch``, which does not repeat a failed rank's one stderr line below it (a longer stderr keeps its tail
block); a mistyped flag or command is one line with the closest match instead of argparse's usage block."""

from __future__ import annotations

import io
import sys

import pytest

from moonrt.cli import main
from moonrt.cluster.launch import launch

ERROR = "moonrt train: error: optim.lr (--lr) = -1.0: expected a finite number > 0"


@pytest.mark.timeout(120)
def test_a_config_error_every_rank_prints_is_printed_once() -> None:
    code = f"import sys; print({ERROR!r}, file=sys.stderr); sys.exit(2)"
    err = io.StringIO()
    assert launch([sys.executable, "-c", code], 3, timeout_s=30, stdout=io.StringIO(), stderr=err) == 2
    text = err.getvalue()
    assert text.count(ERROR) == 1, text
    lines = text.strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith("] " + ERROR), text
    assert "failed: exit code 2" in lines[1] and "its one stderr line is above" in lines[1], text


@pytest.mark.timeout(120)
def test_a_longer_stderr_keeps_its_tail_and_other_lines_are_not_deduplicated() -> None:
    code = "import sys; print('working', file=sys.stderr); print('Traceback: boom', file=sys.stderr); sys.exit(3)"
    err = io.StringIO()
    assert launch([sys.executable, "-c", code], 2, timeout_s=30, stdout=io.StringIO(), stderr=err) == 3
    text = err.getvalue()
    assert text.count("] working") == 2 and "stderr (last 40 lines) ---\nworking\nTraceback: boom\n" in text, text


@pytest.mark.parametrize(("argv", "line"), [
    (["train", "--stpes", "5"], "moonrt train: error: unrecognized argument --stpes (did you mean --steps?); "
                                "moonrt train --help lists the flags"),
    (["train", "--stpes=5", "--outt", "x"],
     "moonrt train: error: unrecognized argument --stpes=5 (did you mean --steps?); also unrecognized: --outt; "
     "moonrt train --help lists the flags"),
    (["mem-plan", "--budget-gb", "80"], "moonrt mem-plan: error: unrecognized argument --budget-gb (did you mean "
                                        "--budget-gib?); moonrt mem-plan --help lists the flags"),
    (["trian"], "moonrt: error: unknown command 'trian' (did you mean train?); expected one of train, launch, "
                "selftest, sbatch, ep-sim, mem-plan, pp-plan, data, checkpoint"),
])
def test_a_mistyped_flag_is_one_line_with_the_closest_match(argv: list[str], line: str,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    out, err = capfd.readouterr()
    assert code == 2 and err.strip().splitlines() == [line] and not out, err
