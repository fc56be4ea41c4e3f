"""The type checker CI runs: ``.venv/bin/mypy`` in the README's test command (what ``.ci/run`` runs), between ruff
and pytest, configured by ``[tool.mypy]`` in pyproject.toml over all of ``moonrt``.

The checker exists to catch what tests miss, such as a constructor called with a keyword it does not accept: the
config must keep that error code on for every module (its backlog of per-module disabled codes never lists
``call-arg``), ignore no moonrt module wholesale, and excuse missing type information only for third-party
packages. The last test runs mypy with the repository's config on a probe file that makes that mistake.
"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)

ROOT = Path(__file__).resolve().parents[1]


def _test_command() -> str:
    """The README's test command, extracted as ``.ci/run`` does (the first non-fence line after the marker)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("<!-- test-command -->") + 1
    return next(line for line in lines[start:] if line.strip() and not line.startswith("```"))


def _mypy_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_ci_runs_mypy_between_ruff_and_pytest() -> None:
    steps = [s.strip() for s in _test_command().split("&&")]
    assert ".venv/bin/mypy" in steps, steps
    ruff = steps.index(".venv/bin/ruff check .")
    pytest_step = next(i for i, s in enumerate(steps) if "pytest" in s)
    assert ruff < steps.index(".venv/bin/mypy") < pytest_step


def test_mypy_is_pinned_in_the_test_extra() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = [d for d in extra if d.startswith("mypy")]
    assert len(pins) == 1 and pins[0].startswith("mypy=="), pins


def test_config_checks_all_of_moonrt_and_keeps_call_arg_everywhere() -> None:
    cfg = _mypy_config()
    assert cfg["files"] == ["moonrt"]
    assert cfg["check_untyped_defs"] is True
    assert cfg["python_version"] == "3.11"
    for override in cfg.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        assert not override.get("ignore_errors"), modules
        assert "call-arg" not in override.get("disable_error_code", []), modules
        if override.get("ignore_missing_imports"):  # third-party packages without type information only
            assert not [m for m in modules if m.split(".")[0] == "moonrt"], modules


@pytest.mark.parametrize(("call", "ok"), [("DistConfig(timeout_s=5.0)", True), ("DistConfig(timeout=5.0)", False)])
def test_mypy_catches_a_constructor_keyword_it_does_not_accept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                call: str, ok: bool) -> None:
    api = pytest.importorskip("mypy.api")  # the test extra installs it
    probe = tmp_path / "probe.py"
    probe.write_text(f"from moonrt.config.runtime import DistConfig\n\n{call}\n")
    monkeypatch.setenv("MYPYPATH", str(ROOT))
    out, err, rc = api.run([str(probe), "--config-file", str(ROOT / "pyproject.toml"),
                            "--cache-dir", str(tmp_path / "cache")])
    if ok:
        assert rc == 0, out + err
    else:
        assert rc == 1, out + err
        assert 'Unexpected keyword argument "timeout" for "DistConfig"' in out and "[call-arg]" in out, out
