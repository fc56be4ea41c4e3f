"""The kernel-backend registry (moonrt.ops.kernels): the choice by device, the config override end to end, errors.

No GPU here: the CUDA case is checked with recording stub backends and a ``torch.device("cuda")`` value (the
registry decides by the device's type; no CUDA tensor is made)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import get_args

import pytest
import torch
import yaml

import moonrt.comm.cp.kcp as kcp
import moonrt.ops.fp8.codec as fp8
from moonrt.cli import main as cli_main
from moonrt.config import ConfigError, from_dict
from moonrt.jobs.train.config import JobConfig, KernelChoice
from moonrt.ops import kda, kernels
from moonrt.ops.kernels import REGISTRY, KernelUnavailable, default_registry, kernel
from moonrt.parallel.context import AttentionContext

CUDA = torch.device("cuda", 0)


def _recorder(calls: list[str], label: str, fn=None):
    """A backend that records ``label`` per call and runs ``fn`` (or returns the label)."""

    def run(*args, **kwargs):
        calls.append(label)
        return label if fn is None else fn(*args, **kwargs)

    return run


def _kda_inputs(T: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, H, K, V = 1, 2, 8, 8
    return {"q": torch.randn(B, T, H, K, generator=g), "k": torch.randn(B, T, H, K, generator=g) / K ** 0.5,
            "v": torch.randn(B, T, H, V, generator=g), "g": -torch.rand(B, T, H, K, generator=g),
            "beta": torch.rand(B, T, H, generator=g)}


def test_auto_picks_numba_on_cpu_tensors() -> None:
    x = torch.zeros(2, 3)
    for op in kernels.OPS:
        assert REGISTRY.choose(op, "auto", x.device).name == "numba", op
    assert kernel("kda_chunk", "auto", x.device) is kda.kda_chunk
    assert kernel("kda_transition", "auto", x.device) is kda.kda_transition
    assert kernel("kda_state_grad", "auto", x.device) is kda.kda_state_grad
    assert kernel("fp8_quantize", "auto", x.device) is fp8.quantize_rows_numba
    assert kernel("fp8_dequantize", "auto", x.device) is fp8.dequantize_rows_numba
    assert kernel("fp8_quantize", "torch", x.device) is fp8.quantize_rows_torch
    assert REGISTRY.choose("kda_chunk", "auto", "meta").name == "torch"  # any other device: torch
    reg = kernels.KernelRegistry()
    reg.register("fp8_quantize", "torch", fp8.quantize_rows_torch)
    assert reg.choose("fp8_quantize", "auto", "cpu").name == "torch"  # CPU without a numba backend: torch


def test_auto_picks_triton_on_cuda_tensors() -> None:
    """On a CUDA device ``auto`` is the Triton backend of every op: recording stubs stand in for the kernels (the
    real ones need a GPU); the KCP seam and the FP8 rows dispatch reach them by the device alone."""
    calls: list[str] = []
    reg = default_registry()
    for op in kernels.OPS:
        reg.register(op, "triton", _recorder(calls, op), devices=("cuda",))
        assert reg.choose(op, "auto", CUDA).name == "triton"
        assert reg.resolve(op, "auto", CUDA)() == op
    assert calls == list(kernels.OPS)
    calls.clear()
    # the global registry, as the call sites use it (restored after the block)
    with REGISTRY.swapped("kda_chunk", "triton", _recorder(calls, "c"), devices=("cuda",)), \
            REGISTRY.swapped("kda_transition", "triton", _recorder(calls, "t"), devices=("cuda",)), \
            REGISTRY.swapped("kda_state_grad", "triton", _recorder(calls, "s"), devices=("cuda",)):
        chunk, transition, state_grad, _ = kcp._default_fns("auto", CUDA)
        assert (chunk(), transition(), state_grad()) == ("c", "t", "s")
        cpu_chunk, *_ = kcp._default_fns("auto", torch.device("cpu"))
        assert cpu_chunk is kda.kda_chunk
    assert calls == ["c", "t", "s"]
    assert REGISTRY.choose("kda_chunk", "auto", CUDA).target == "moonrt.ops.kda.backends.triton:kda_chunk"  # restored


def test_choice_reaches_the_backend_at_each_call_site() -> None:
    """``kernels.kda`` through the attention context and KCP's defaults, ``kernels.fp8`` through the codec's API:
    each call runs the chosen backend (recording wrappers around the real ones; results unchanged)."""
    x = _kda_inputs()
    calls: list[str] = []
    with REGISTRY.swapped("kda_chunk", "torch", _recorder(calls, "torch", kda.kda_chunk)), \
            REGISTRY.swapped("kda_chunk", "numba", _recorder(calls, "numba", kda.kda_chunk), devices=("cpu",)):
        o_t, _ = AttentionContext(kda_kernel="torch").kda(**x)
        o_a, _ = AttentionContext().kda(**x)
        assert kcp._default_fns("torch", torch.device("cpu"))[0] is REGISTRY.resolve("kda_chunk", "torch", "cpu")
    assert calls == ["torch", "numba"] and torch.equal(o_t, o_a)
    calls.clear()
    y = torch.randn(3, 200)
    with REGISTRY.swapped("fp8_quantize", "torch", _recorder(calls, "q", fp8.quantize_rows_torch)), \
            REGISTRY.swapped("fp8_dequantize", "torch", _recorder(calls, "d", fp8.dequantize_rows_torch)):
        p, s = fp8.quantize(y, kernel="torch")
        z = fp8.dequantize(p, s, y.shape, y.dtype, kernel="torch")
        (p2, s2), = fp8.quantize_many([y], kernel="torch")
        z2, = fp8.dequantize_many([(p2, s2, tuple(y.shape), y.dtype)], kernel="torch")
        pn, sn = fp8.quantize(y)
    assert calls == ["q", "d", "q", "d"]
    assert torch.equal(p.view(torch.uint8), pn.view(torch.uint8)) and torch.equal(s, sn) and torch.equal(z, z2)


def _kcp_rank(rank: int, world: int, x: dict[str, torch.Tensor]) -> dict:
    """KCP through ``ContextParallel(kda_kernel="torch")`` on this rank's slice, every KDA piece recorded."""
    from moonrt.comm.cp.context import ContextParallel
    from moonrt.comm.cp.ops import slice_bounds

    calls: list[str] = []
    with contextlib.ExitStack() as stack:
        for op in kernels.FAMILIES["kda"]:
            for name in ("torch", "numba"):
                stack.enter_context(REGISTRY.swapped(op, name, _recorder(calls, f"{op}:{name}", getattr(kda, op)),
                                                     devices=None if name == "torch" else ("cpu",)))
        a, b = slice_bounds(x["q"].shape[1], world, rank)
        leaves = {n: x[n][:, a:b].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
        o, _ = ContextParallel(None, kda_kernel="torch").kda(**leaves)
        (o * x["do"][:, a:b]).sum().backward()
    return {"calls": sorted(set(calls)), "o": o.detach(), "dq": leaves["q"].grad}


def test_kcp_runs_the_chosen_backend_on_two_ranks() -> None:
    """``ContextParallel(kda_kernel=...)`` -> ``kcp_kda(kernel=...)``: the chunk, the transition summary and the
    state gradient all run the chosen backend on every rank, and the result is the single-process one."""
    from dist import dist_run
    from numerics import rel_l2

    x = _kda_inputs(T=40, seed=4)
    x["do"] = torch.randn_like(x["v"])
    got = dist_run(_kcp_rank, 2, x, timeout=240)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    o, _ = kda.kda_chunk(**leaves)
    (o * x["do"]).sum().backward()
    want = ["kda_chunk:torch", "kda_state_grad:torch", "kda_transition:torch"]
    assert [r["calls"] for r in got] == [want, want]
    # KCP on fp32 vs single-process fp32: tests/comm/test_kcp.py's bound (relative RMS 1e-5)
    assert rel_l2(torch.cat([r["o"] for r in got], dim=1), o) <= 1e-5
    assert rel_l2(torch.cat([r["dq"] for r in got], dim=1), leaves["q"].grad) <= 1e-5


def test_errors_are_one_clear_line(monkeypatch) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^kernels\.kda = 'cuda': expected one of auto, torch, numba, triton, "
                                         r"fla$"):
        kernel("kda_chunk", "cuda", cpu)
    with pytest.raises(ValueError, match=r"^kernels\.fp8 = 'numba': the numba backend of fp8_quantize runs on cpu "
                                         r"tensors, got cuda tensors; expected another choice"):
        kernel("fp8_quantize", "numba", CUDA)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"runs on cuda tensors, got cpu tensors \(or set TRITON_INTERPRET=1"):
        kernel("kda_chunk", "triton", cpu)
    reg = kernels.KernelRegistry()
    with pytest.raises(ValueError, match=r"^kernels\.kda = 'auto': kda_chunk has no torch backend; expected one of "
                                         r"auto$"):
        reg.resolve("kda_chunk", "auto", "meta")
    with pytest.raises(ValueError, match="expected 'module:function' or a callable"):
        reg.register("kda_chunk", "torch", "moonrt.ops.kda.kda_chunk")
    # Triton not installed: one line with the install command and the way out
    reg.register("kda_chunk", "triton", "moonrt.ops.kda.backends.triton:kda_chunk", devices=("cuda",),
                 requires="triton")
    real_find_spec = kernels.importlib.util.find_spec
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real_find_spec(n))
    with pytest.raises(KernelUnavailable) as info:
        reg.resolve("kda_chunk", "auto", CUDA)
    msg = str(info.value)
    assert msg == ("kernels.kda = 'auto': kda_chunk runs the triton backend, but triton is not installed: pip install "
                   "'triton==3.8.0', or set kernels.kda: torch")
    monkeypatch.undo()
    # a backend module that is not in this install (e.g. kda_triton before it is written): a clear error, no crash
    reg.register("kda_chunk", "triton", "moonrt.ops.no_such_kernels:kda_chunk", devices=("cuda",))
    with pytest.raises(KernelUnavailable, match=r"^kernels\.kda = 'triton': the triton backend of kda_chunk is "
                                                r"moonrt\.ops\.no_such_kernels:kda_chunk, but module "
                                                r"moonrt\.ops\.no_such_kernels is not in this install"):
        reg.resolve("kda_chunk", "triton", CUDA)
    reg.register("kda_chunk", "triton", "moonrt.ops.kda:no_such_function", devices=("cuda",))
    with pytest.raises(KernelUnavailable, match="moonrt.ops.kda has no function no_such_function"):
        reg.resolve("kda_chunk", "triton", CUDA)
    with pytest.raises(ValueError, match=r"^kernels\.kda = 'gpu': expected one of auto, torch, numba, triton, "
                                         r"fla$"):
        AttentionContext(kda_kernel="gpu")


def test_kernels_config_field(tmp_path: Path) -> None:
    assert get_args(KernelChoice) == kernels.CHOICES
    job = from_dict(JobConfig, {"kernels": {"kda": "torch"}})
    assert (job.kernels.kda, job.kernels.fp8) == ("torch", "auto")
    with pytest.raises(ConfigError, match=r"^kernels\.kda = 'cuda': expected one of 'auto', 'torch', 'numba', "
                                          r"'triton', 'fla'$"):
        from_dict(JobConfig, {"kernels": {"kda": "cuda"}})
    with pytest.raises(ConfigError, match=r"^kernels\.fp8 = 'x': expected one of 'auto', 'torch', 'numba', "
                                          r"'triton'$"):
        job.kernels.fp8 = "x"
        from moonrt.config import validate

        validate(job)


def test_train_override_reaches_the_chosen_backend(tmp_path: Path, capsys) -> None:
    """``moonrt train --set kernels.kda=torch --set kernels.fp8=torch`` with an FP8 memory policy: every KDA call
    and every FP8 encode/decode runs the torch backend (none the numba one), and config.yaml records the choice."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 500)
    policy = tmp_path / "fp8.yaml"
    policy.write_text("default: fp8\n")
    calls: list[str] = []
    real = (("kda_chunk", kda.kda_chunk), ("fp8_quantize", fp8.quantize_rows_torch),
            ("fp8_dequantize", fp8.dequantize_rows_torch))
    swaps = [(op, name, fn) for op, fn in real for name in ("torch", "numba")]
    out = tmp_path / "o"
    with contextlib.ExitStack() as stack:
        for op, name, fn in swaps:
            stack.enter_context(REGISTRY.swapped(op, name, _recorder(calls, f"{op}:{name}", fn),
                                                 devices=None if name == "torch" else ("cpu",)))
        rc = cli_main(["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--corpus", str(corpus),
                       "--out", str(out), "--no-progress", "--memory-policy", str(policy), "--set", "kernels.kda=torch",
                       "--set", "kernels.fp8=torch", "--set", "optim.eval_windows=1"])
        assert rc == 0, capsys.readouterr().err
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["kernels"] == {"kda": "torch", "fp8": "torch", "moonep": "auto"}
    used = set(calls)
    assert used == {"kda_chunk:torch", "fp8_quantize:torch", "fp8_dequantize:torch"}, used


def test_ci_installs_and_requires_the_pinned_triton() -> None:
    """The test extra pins the Triton the install hint names, and CI makes a missing Triton a failure."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = [d for d in extra if d.startswith("triton")]
    assert pins == [kernels.TRITON_INSTALL.split("'")[1]]
    assert "\nexport MOONRT_REQUIRE_TRITON=1\n" in (root / ".ci" / "run").read_text()


def test_train_cli_unusable_backend_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    """A backend that cannot run here ends ``moonrt train`` with one line and exit 2, not a traceback: Triton on CPU
    tensors (no interpreter), and a backend whose module is missing (as Triton's would be: KernelUnavailable)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 500)
    base = ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--corpus", str(corpus), "--no-progress",
            "--set", "optim.eval_windows=1"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(pytest.MonkeyPatch.context()).delenv("TRITON_INTERPRET", raising=False)
        assert cli_main([*base, "--out", str(tmp_path / "a"), "--set", "kernels.kda=triton"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moonrt train: error: kernels.kda = 'triton': the triton backend of kda_chunk runs on "
                              "cuda tensors, got cpu tensors") and "\n" not in err, err
        stack.enter_context(REGISTRY.swapped("kda_chunk", "numba", "moonrt.ops.no_such_kernels:kda_chunk",
                                             devices=("cpu",)))
        assert cli_main([*base, "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moonrt train: error: kernels.kda = 'auto': the numba backend of kda_chunk is "
                              "moonrt.ops.no_such_kernels:kda_chunk, but module") and "\n" not in err, err
