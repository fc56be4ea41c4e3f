"""``kernels.kda: fla``: fla-core's ``chunk_kda`` behind moonrt's KDA contract (moonrt.ops.kda.backends.fla).

Without fla or Triton the registry tests still run (recording stubs, the missing-package line, the config, the CLI);
the numerics tests skip with the reason where fla-core is absent (``pip install 'moonrt[fla]'``; the ``test`` extra
installs it). Under Triton's interpreter (CPU, the ``triton_kernels`` fixture) fla runs with two shims that live in
this file only, never in the package: its autotuners keep their first config (benchmarking needs a GPU driver), and a
kernel's Python ``range`` loop yields Triton scalars (compiled Triton's loop variable is a tensor; fla's kernels call
``.to(tl.int64)`` on it, which a Python int under the interpreter lacks).

Tolerances are fla's own, from its tests of ``chunk_kda`` against ``naive_recurrent_kda``
(fla-org/flash-linear-attention ``tests/ops/test_kda.py``, ``test_chunk``): relative RMS error
``||x - ref||_2 / ||ref||_2`` (fla.utils.testing ``get_err_ratio``) below 0.005 for o and the final state, 0.008 for
dq, dk, dv and dh0, 0.02 for dg and dbeta, 0.001 for dA_log and ddt_bias. Those are fla's bounds for fp16 operands on
a GPU; under the interpreter fla computes in fp32 numpy and the observed errors are ~1e-6 (fp32 rounding), so these
tests hold the adapter to fla's contract with a wide margin, and would catch any mapping error (a wrong scale, state
layout, gate or offset moves the error to O(1)).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
import torch

from moonrt.cli import main as cli_main
from moonrt.config import ConfigError, from_dict
from moonrt.jobs.train.config import JobConfig, KdaKernelChoice, KernelChoice
from moonrt.ops import kda, kernels
from moonrt.ops.kernels import REGISTRY, KernelUnavailable, default_registry
from moonrt.parallel.context import AttentionContext

CUDA = torch.device("cuda", 0)

FLA_TOL = {"o": 0.005, "S": 0.005, "q": 0.008, "k": 0.008, "v": 0.008, "initial_state": 0.008, "g": 0.02,
           "beta": 0.02, "A_log": 0.001, "dt_bias": 0.001}
"""fla's tolerances (module docstring): output, final state and the gradient of each input."""


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's error ratio: relative RMS error of ``x`` against ``ref``, in fp64."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / (ref.norm() + 1e-30))


def _tensor_range(*bounds: object) -> Iterator[object]:
    import triton.runtime.interpreter as interpreter

    for i in range(*(int(b) for b in bounds)):  # type: ignore[call-overload]
        yield interpreter._implicit_cvt(i)


@pytest.fixture
def fla_device(triton_kernels, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The device fla's kernels run on here (module docstring: the interpreter's shims, this test's only)."""
    pytest.importorskip("fla.ops.kda", reason="fla-core is not installed (pip install 'moonrt[fla]')")
    if triton_kernels.device.type == "cpu":
        import triton.runtime.autotuner as autotuner
        import triton.runtime.interpreter as interpreter

        prune = autotuner.Autotuner.prune_configs
        monkeypatch.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])
        patch_lang = interpreter._patch_lang

        def patch_with_range(fn):
            scope = patch_lang(fn)
            scope.set_attr(sys.modules[fn.__module__], "range", _tensor_range)
            return scope

        monkeypatch.setattr(interpreter, "_patch_lang", patch_with_range)
    return triton_kernels.device


def _inputs(B: int, T: int, H: int, HV: int, K: int, V: int, seed: int, device: torch.device,
            n_states: int | None = None) -> dict[str, torch.Tensor]:
    """fp64 leaves: unit-norm keys, log-decays in K3's gate range (-5, 0), beta in (0, 1), a random initial state."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=rn(B, T, H, K), k=torch.nn.functional.normalize(rn(B, T, H, K), dim=-1), v=rn(B, T, HV, V),
             g=-5 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64),
             beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
             initial_state=rn(n_states or B, HV, K, V))
    return {n: t.to(device).requires_grad_() for n, t in x.items()}


def _run(fn, x: dict[str, torch.Tensor], dtype: torch.dtype, seed: int, **kw) -> dict[str, torch.Tensor]:
    """``fn``'s output, final state and the gradient of every leaf of ``x`` for a fixed random cotangent."""
    args = {n: t.to(dtype) for n, t in x.items()}
    o, S = fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), output_final_state=True,
              **args, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.device)
    grads = torch.autograd.grad((o.double() * do).sum() + (S.double() * dS).sum(), list(x.values()))
    return {"o": o, "S": S, **dict(zip(x, grads))}


def _assert_within_fla_tolerances(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    errors = {n: _rel(got[n], ref[n]) for n in ref}
    bad = {n: e for n, e in errors.items() if not e < FLA_TOL[n]}
    assert not bad, f"over fla's tolerances {FLA_TOL}: {bad} (all: {errors})"


# ---- the registry, the config and the CLI (no fla needed) ----


def test_fla_is_a_kda_backend_chosen_only_by_name() -> None:
    """``fla`` is a ``kernels.kda`` choice with a ``kda_chunk`` backend on CUDA; ``auto`` never picks it; KCP's
    summaries and the other families have none (one line each)."""
    assert kernels.family_choices("kda") == (*kernels.CHOICES, "fla")
    assert kernels.family_choices("fp8") == kernels.CHOICES
    b = REGISTRY.choose("kda_chunk", "fla", CUDA)
    assert (b.name, b.target, b.devices, b.requires) == ("fla", "moonrt.ops.kda.backends.fla:kda_chunk", ("cuda",),
                                                         "fla")
    assert REGISTRY.choose("kda_chunk", "auto", CUDA).name == "triton"
    with pytest.raises(ValueError, match=r"^kernels\.kda = 'fla': kda_transition has no fla backend; expected one of "
                                         r"auto, torch, numba, triton$"):
        REGISTRY.choose("kda_transition", "fla", CUDA)
    with pytest.raises(ValueError, match=r"^kernels\.fp8 = 'fla': expected one of auto, torch, numba, triton$"):
        REGISTRY.choose("fp8_quantize", "fla", CUDA)
    with pytest.raises(ValueError, match=r"^kernels\.moonep = 'fla': expected one of auto, torch, numba, triton$"):
        kernels.check_choice("moonep", "fla")
    assert AttentionContext(kda_kernel="fla").kda_kernel == "fla"


def test_attention_context_reaches_the_fla_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KDA layer's seam resolves ``kernels.kda = fla`` through the registry and passes moonrt's call unchanged
    (a recording stub stands in for fla: the call it gets is the contract's)."""
    calls: list[dict[str, object]] = []

    def stub(q, k, v, g, beta, **kw):
        calls.append(kw)
        return v.clone(), None

    x = {n: t.detach().float() for n, t in _inputs(1, 8, 2, 2, 4, 4, 0, torch.device("cpu")).items()}
    with REGISTRY.swapped("kda_chunk", "fla", stub, devices=None):
        o, S = AttentionContext(kda_kernel="fla").kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.5)
    assert torch.equal(o, x["v"]) and S is None
    assert calls == [{"scale": 0.5, "initial_state": None, "output_final_state": False, "cu_seqlens": None}]


def test_missing_fla_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla-core not installed: the first call says ``pip install 'moonrt[fla]'`` in one line (the registry, before
    the backend module is imported); fla present but its import failing (e.g. no Triton): the backend says so."""
    reg = default_registry()
    real_find_spec = kernels.importlib.util.find_spec
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda n, *a: None if n == "fla" else real_find_spec(n))
    with pytest.raises(KernelUnavailable) as info:
        reg.resolve("kda_chunk", "fla", CUDA)
    assert str(info.value) == ("kernels.kda = 'fla': kda_chunk runs the fla backend, but fla is not installed: pip "
                               "install 'moonrt[fla]' (fla-core), or set kernels.kda: torch")
    monkeypatch.undo()
    from moonrt.ops.kda.backends import fla as fla_backend

    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # import fails as it would without fla or its Triton
    with pytest.raises(KernelUnavailable) as info:
        fla_backend._chunk_kda()
    msg = str(info.value)
    assert msg.startswith("kernels.kda = 'fla': fla's chunk_kda cannot be imported (") and "\n" not in msg, msg
    assert msg.endswith("pip install 'moonrt[fla]' (fla-core with Triton), or set kernels.kda: torch"), msg


def test_kernels_kda_fla_config() -> None:
    """``kernels.kda: fla`` is a valid job config (single-rank KDA); ``fla`` for another family, or with context
    parallelism (KCP's summaries have no fla form), is one ConfigError naming the key."""
    assert get_args(KdaKernelChoice) == kernels.family_choices("kda")
    assert get_args(KernelChoice) == kernels.CHOICES
    assert from_dict(JobConfig, {"kernels": {"kda": "fla"}}).kernels.kda == "fla"
    with pytest.raises(ConfigError, match=r"^kernels\.fp8 = 'fla': expected one of 'auto', 'torch', 'numba', "
                                          r"'triton'$"):
        from_dict(JobConfig, {"kernels": {"fp8": "fla"}})
    with pytest.raises(ConfigError, match=r"^kernels\.kda = 'fla': expected one of 'auto', 'torch', 'numba', "
                                          r"'triton' with parallel\.cp = 2 \(--cp\): KCP's segment summaries"):
        from_dict(JobConfig, {"kernels": {"kda": "fla"}, "parallel": {"cp": 2}})


@pytest.mark.slow  # ~5 s on a shared CPU
def test_train_cli_fla_on_cpu_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    """``moonrt train --set kernels.kda=fla`` on CPU: one line naming the key and that fla's kernels need CUDA,
    exit 2 (installed or not: the device is checked before fla is looked for)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 500)
    if importlib.util.find_spec("triton") is not None:
        import triton.language  # noqa: F401  (decorated now, under conftest's interpreter switch, not in the run below)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        rc = cli_main(["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--corpus", str(corpus),
                       "--no-progress", "--set", "optim.eval_windows=1", "--out", str(tmp_path / "o"), "--set",
                       "kernels.kda=fla"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err == ("moonrt train: error: kernels.kda = 'fla': the fla backend of kda_chunk runs on cuda tensors, got "
                   "cpu tensors (fla's Triton kernels need a CUDA GPU); expected another choice of auto, torch, "
                   "numba, triton, fla"), err


def test_contract_errors_before_fla_runs() -> None:
    """What moonrt's contract refuses, the adapter refuses in one line before fla sees it: a chunk size fla lacks,
    fp64 inputs (fla computes in fp32), a wrong state shape, a NaN decay, ``safe_gate`` with a decay below -5."""
    from moonrt.ops.kda.backends.fla import kda_chunk as fla_chunk

    x = {n: t.detach().float() for n, t in _inputs(1, 8, 2, 2, 4, 4, 0, torch.device("cpu")).items()}
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=r"^chunk_size = 128: kernels\.kda = 'fla' \(fla's chunk_kda\) expects one "
                                         r"of 32, 64$"):
        fla_chunk(q, k, v, g, beta, chunk_size=128)
    with pytest.raises(ValueError, match=r"compute in torch\.float64: kernels\.kda = 'fla'.*kernels\.kda: torch for "
                                         r"fp64$"):
        fla_chunk(q.double(), k, v, g, beta)
    with pytest.raises(ValueError, match=r"^initial_state\.shape = \(1, 2, 4, 3\): expected \[N, HV, K, V\] = "
                                         r"\[1, 2, 4, 4\]$"):
        fla_chunk(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"^g\.min\(\) = nan: expected per-token log-decays <= 0, not NaN$"):
        fla_chunk(q, k, v, torch.full_like(g, float("nan")), beta)
    with pytest.raises(ValueError, match=r"with safe_gate = True: fla's safe gate expects log-decays in \[-5\.0, 0\)"):
        fla_chunk(q, k, v, g - 10.0, beta, safe_gate=True)
    with pytest.raises(ValueError, match=r"^v\.shape = "):  # moonrt's shape check (GVA rule)
        fla_chunk(q, k, v[:, :, :1].expand(1, 8, 3, 4), g, beta)


# ---- fla's kernels under the interpreter (or on a GPU) against moonrt ----


@pytest.mark.slow  # ~5 s on a shared CPU
def test_fla_equals_the_fp64_recurrence_and_moonrt_chunk(fla_device: torch.device) -> None:
    """fla's ``chunk_kda`` through the registry, forward and backward (o, final state, dq, dk, dv, dg, dbeta, dh0),
    within fla's tolerances of the fp64 recurrence and of moonrt's own chunk op (fp64), at T not a multiple of the
    chunk, with a full reset (``-inf``) and a very strong decay (-1e4) among the K3-range log-decays."""
    fla_chunk = kernels.kernel("kda_chunk", "fla", fla_device)
    x = _inputs(1, 40, 1, 1, 16, 16, seed=1, device=fla_device)
    with torch.no_grad():
        x["g"][0, 7, 0, :3] = float("-inf")
        x["g"][0, 20, 0, 5] = -1e4
    got = _run(fla_chunk, x, torch.float32, seed=2)
    assert got["o"].dtype == torch.float32 and got["S"].dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in got.values())
    _assert_within_fla_tolerances(got, _run(kda.kda_recurrent, x, torch.float64, seed=2))
    _assert_within_fla_tolerances(got, _run(kda.kda_chunk, x, torch.float64, seed=2))


@pytest.mark.slow
def test_fla_options_varlen_gva_equal_moonrt(fla_device: torch.device) -> None:
    """Packed sequences (``cu_seqlens``, one initial state each), grouped value heads and every fla option passed to
    fla's own kernels (in-kernel L2 norm, gate with A_log and dt_bias, beta sigmoid, V-first states) equal moonrt's
    ``kda_chunk`` in fp64 with the same options: outputs, final states and every gradient (A_log and dt_bias
    included) within fla's tolerances; bf16 inputs come back in bf16, computed in fp32 (the contract)."""
    fla_chunk = kernels.kernel("kda_chunk", "fla", fla_device)
    x = _inputs(1, 100, 1, 2, 32, 16, seed=3, device=fla_device, n_states=2)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        x["initial_state"] = x["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
        x["g"] = torch.randn(x["g"].shape, generator=gen, dtype=torch.float64).to(fla_device).requires_grad_()
        x["beta"] = torch.randn(x["beta"].shape, generator=gen, dtype=torch.float64).to(fla_device).requires_grad_()
    x["A_log"] = (0.5 * torch.randn(2, generator=gen, dtype=torch.float64)).to(fla_device).requires_grad_()
    x["dt_bias"] = torch.randn(2 * 32, generator=gen, dtype=torch.float64).to(fla_device).requires_grad_()
    opts = dict(cu_seqlens=torch.tensor([0, 30, 100]), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    got = _run(fla_chunk, x, torch.float32, seed=5, **opts)
    assert got["o"].shape == (1, 100, 2, 16) and got["S"].shape == (2, 2, 16, 32)
    _assert_within_fla_tolerances(got, _run(kda.kda_chunk, x, torch.float64, seed=5, **opts))
    with torch.no_grad():
        rest = {n: t.detach().float() for n, t in x.items() if n not in ("q", "k", "v", "g", "beta")}
        five = [x[n].detach().bfloat16() for n in ("q", "k", "v", "g", "beta")]
        o16, _ = fla_chunk(*five, **rest, **opts)
        o32, _ = fla_chunk(*(t.float() for t in five), **rest, **opts)
    assert o16.dtype == torch.bfloat16 and torch.equal(o16, o32.bfloat16())

