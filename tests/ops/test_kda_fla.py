"""fla-compatible keyword options of kda_chunk / kda_recurrent (moonrt.ops.kda.fla_options): each option equals the same
computation done outside the op (fp64, 1e-12: outputs, final state and the gradient of every input, A_log and
dt_bias included); output dtype follows q; a bad option is one error naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_equal_f64

from moonrt.ops.kda import kda_chunk, kda_recurrent

B, T, H, K, V = 1, 70, 2, 8, 6


def _leaves(HV: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    return dict(q=rn(B, T, H, K), k=rn(B, T, H, K), v=rn(B, T, HV, V), g=rn(B, T, HV, K) - 1.0,
                beta=rn(B, T, HV), A_log=0.3 * rn(HV), dt_bias=0.5 * rn(HV * K), initial_state=rn(B, HV, K, V))


def _outside(x: dict[str, torch.Tensor], opts: dict[str, object]) -> dict[str, torch.Tensor]:
    """The options applied by hand: plain kda_recurrent inputs (the state layout is mapped by the caller)."""
    q, k, g, beta, S0 = x["q"], x["k"], x["g"], x["beta"], x["initial_state"]
    HV = x["v"].shape[2]
    if opts.get("use_qk_l2norm_in_kernel"):
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)  # value head j -> qk j // G
    if opts.get("use_gate_in_kernel"):
        z = g + x["dt_bias"].view(HV, K)
        a = x["A_log"].exp().view(HV, 1) if opts.get("A_log", True) is not None else 1.0  # A_log=None: exp(0)
        lb = opts.get("lower_bound")
        g = -a * F.softplus(z) if lb is None else lb * torch.sigmoid(a * z)
    else:
        g = -F.softplus(-g)  # a valid log-decay (logsigmoid) for the runs without the in-kernel gate
    if opts.get("use_beta_sigmoid_in_kernel"):
        beta = (2.0 if opts.get("allow_neg_eigval") else 1.0) * torch.sigmoid(beta)
    else:
        beta = torch.sigmoid(beta)
    return dict(q=q, k=k, v=x["v"], g=g, beta=beta, initial_state=S0)


def _op_inputs(x: dict[str, torch.Tensor], opts: dict[str, object]) -> dict[str, object]:
    """What the op is given: raw gate / beta where the option takes them raw, else the same values as outside."""
    g = x["g"] if opts.get("use_gate_in_kernel") else -F.softplus(-x["g"])
    beta = x["beta"] if opts.get("use_beta_sigmoid_in_kernel") else torch.sigmoid(x["beta"])
    S0 = x["initial_state"].transpose(-1, -2) if opts.get("state_v_first") else x["initial_state"]
    kw: dict[str, object] = dict(q=x["q"], k=x["k"], v=x["v"], g=g, beta=beta, initial_state=S0, **opts)
    if opts.get("use_gate_in_kernel"):
        kw.update(dt_bias=x["dt_bias"])
        if "A_log" not in opts:
            kw.update(A_log=x["A_log"])
    return kw


OPTIONS = {
    "plain": {},
    "gva": {},
    "l2norm": {"use_qk_l2norm_in_kernel": True},
    "gate": {"use_gate_in_kernel": True},
    "gate_lower_bound": {"use_gate_in_kernel": True, "lower_bound": -5.0, "safe_gate": True},
    "gate_lower_bound_strong": {"use_gate_in_kernel": True, "lower_bound": -60.0},
    "gate_lower_bound_no_A_log": {"use_gate_in_kernel": True, "lower_bound": -3.0, "A_log": None},
    "beta_sigmoid": {"use_beta_sigmoid_in_kernel": True},
    "neg_eigval": {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
    "state_v_first": {"state_v_first": True},
    "all": {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "lower_bound": -5.0,
            "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True, "state_v_first": True},
}


@pytest.mark.parametrize("fn", [kda_chunk, kda_recurrent], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_equals_the_computation_outside_the_op(name: str, fn) -> None:
    opts = OPTIONS[name]
    HV = 2 * H if name in ("gva", "all", "gate") else H
    x = _leaves(HV, seed=len(name))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, S = fn(**_op_inputs(leaves, opts), output_final_state=True)
    assert o.shape == (B, T, HV, V)
    assert S.shape == ((B, HV, V, K) if opts.get("state_v_first") else (B, HV, K, V))
    gen = torch.Generator().manual_seed(1)
    w_o, w_s = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(S.shape, generator=gen,
                                                                                     dtype=torch.float64)
    ((o * w_o).sum() + (S * w_s).sum()).backward()
    ref_leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    plain = _outside(ref_leaves, opts)
    o_r, S_r = kda_recurrent(**plain, output_final_state=True)
    if opts.get("state_v_first"):
        S_r = S_r.transpose(-1, -2)
    ((o_r * w_o).sum() + (S_r * w_s).sum()).backward()
    assert_equal_f64(o.detach(), o_r.detach(), f"{name} o")
    assert_equal_f64(S.detach(), S_r.detach(), f"{name} S")
    for n, t in leaves.items():
        if ref_leaves[n].grad is None:
            assert t.grad is None or not t.grad.any(), n
            continue
        assert_equal_f64(t.grad, ref_leaves[n].grad, f"{name} d{n}")


def test_gva_with_cu_seqlens_and_all_options() -> None:
    """GVA and every option together with packed sequences: equal to per-sequence recurrent calls outside."""
    opts = OPTIONS["all"]
    x = _leaves(2 * H, seed=3)
    cu = torch.tensor([0, 30, 30, 70])
    x["initial_state"] = torch.randn(3, 2 * H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    o, S = kda_chunk(**_op_inputs(x, opts), output_final_state=True, cu_seqlens=cu, chunk_size=16)
    plain = _outside(x, opts)
    for i, (a, b) in enumerate(((0, 30), (30, 30), (30, 70))):
        o_i, S_i = kda_recurrent(**{n: t[:, a:b] for n, t in plain.items() if n != "initial_state"},
                                 initial_state=plain["initial_state"][i : i + 1], output_final_state=True)
        if b > a:
            assert_equal_f64(o[:, a:b], o_i, f"o[{i}]")
        assert_equal_f64(S[i : i + 1], S_i.transpose(-1, -2), f"S[{i}]")


def test_output_dtype_follows_q() -> None:
    x = _leaves(H, seed=5)
    t5 = dict(q=x["q"].float(), k=x["k"].float(), v=x["v"].bfloat16(), g=-F.softplus(-x["g"]).float(),
              beta=torch.sigmoid(x["beta"]).float())
    for fn in (kda_chunk, kda_recurrent):
        assert fn(**t5)[0].dtype == torch.float32
        assert fn(**{**t5, "q": t5["q"].bfloat16(), "v": t5["v"].float()})[0].dtype == torch.bfloat16


BAD = [
    ({"v": torch.zeros(B, T, 3, V)}, ValueError, "v.shape = (1, 70, 3, 6): expected [B, T, HV, V]"),
    ({"g": torch.zeros(B, T, H, K)}, ValueError, "g.shape = (1, 70, 2, 8): expected [B, T, HV, K] = [1, 70, 4, 8]"),
    ({"beta": torch.zeros(B, T, H)}, ValueError, "beta.shape = (1, 70, 2): expected [B, T, HV] = [1, 70, 4]"),
    ({"use_qk_l2norm_in_kernel": 1}, TypeError, "use_qk_l2norm_in_kernel = 1: expected a bool"),
    ({"state_v_first": "yes"}, TypeError, "state_v_first = 'yes': expected a bool"),
    ({"allow_neg_eigval": True}, ValueError, "allow_neg_eigval = True: expected use_beta_sigmoid_in_kernel = True"),
    ({"A_log": torch.zeros(4)}, ValueError, "A_log given with use_gate_in_kernel = False"),
    ({"lower_bound": -5.0}, ValueError, "lower_bound given with use_gate_in_kernel = False"),
    ({"use_gate_in_kernel": True}, ValueError, "A_log = None with use_gate_in_kernel = True: expected a tensor [HV]"),
    ({"use_gate_in_kernel": True, "A_log": torch.zeros(2)}, ValueError, "A_log.shape = (2,): expected [HV] = [4]"),
    ({"use_gate_in_kernel": True, "A_log": torch.zeros(4), "dt_bias": torch.zeros(8)}, ValueError,
     "dt_bias.shape = (8,): expected [HV * K] = [32]"),
    ({"use_gate_in_kernel": True, "lower_bound": 0.5}, ValueError, "lower_bound = 0.5: expected a finite negative"),
    ({"use_gate_in_kernel": True, "A_log": torch.zeros(4), "safe_gate": True}, ValueError,
     "lower_bound = None with safe_gate = True"),
    ({"state_v_first": True, "initial_state": torch.zeros(B, 2, V, K)}, ValueError,
     "initial_state.shape = (1, 2, 6, 8): expected [N, HV, V, K] with HV = 4"),
]


@pytest.mark.parametrize(("override", "exc", "msg"), BAD, ids=[m.split(":")[0] for _, _, m in BAD])
@pytest.mark.parametrize("fn", [kda_chunk, kda_recurrent], ids=["chunk", "recurrent"])
def test_bad_option_is_one_error_naming_it(fn, override: dict[str, object], exc: type, msg: str) -> None:
    x = _leaves(2 * H, seed=6)
    kw = {**dict(q=x["q"], k=x["k"], v=x["v"], g=-F.softplus(-x["g"]), beta=torch.sigmoid(x["beta"])), **override}
    with pytest.raises(exc) as info:
        fn(**kw)
    assert str(info.value).startswith(msg), str(info.value)
    with pytest.raises(TypeError, match="cp_context"):  # an option fla has and moonrt does not: Python's error
        fn(**{n: kw[n] for n in ("q", "k", "v", "g", "beta")}, cp_context=None)
