"""Activation-memory policies on k3_tiny, side by side in one run (K3_SYSTEMS §8).

For keep / recompute / FP8 / disk offload / the planner-chosen policy: median step time
(forward + backward), peak bytes saved for backward per tier, and the gradient error against the
keep run. The planner's policy comes from ``moonrt.memory.plan`` on a traced k3_tiny profile with
a device budget of half the keep run's activation peak (plus the static terms).

    .venv/bin/python benchmarks/bench_memory.py --batch 2 --seq-len 128 --steps 3 --out /tmp/bench_memory.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from moonrt.config import from_dict
from moonrt.memory.manager import ActivationManager
from moonrt.memory.model_memory import GIB, JobLayout, rank_models
from moonrt.memory.plan import Hardware, plan_memory
from moonrt.memory.policy import MemoryPolicy
from moonrt.models.k3.memory import param_sizes, policy_dict
from moonrt.models.k3.memory_trace import policy_for_all, traced_profile
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model

FP8_CLASSES = ["layers.*.moe", "layers.*.ffn", "layers.*.attn.*proj", "layers.*.attn_norm", "layers.*.ffn_norm",
               "attn_res.sublayer_input"]


def _model() -> K3Model:
    torch.manual_seed(0)
    return K3Model(k3_tiny())


def _tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run_policy(policy: MemoryPolicy | None, batch: int, seq: int, steps: int) -> dict:
    model = _model()
    mgr = ActivationManager(model, policy) if policy is not None else None
    times, grads = [], None
    for step in range(steps + 1):  # step 0 warms up
        model.zero_grad(set_to_none=True)
        tok = _tokens(batch, seq)
        t0 = time.perf_counter()
        if mgr is not None:
            if step == 1:
                mgr.accounting.reset()
            with mgr:
                loss = model.loss_sum(tok, tok)
        else:
            loss = model.loss_sum(tok, tok)
        loss.backward()
        if step:
            times.append(time.perf_counter() - t0)
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    out = {"step_s": statistics.median(times), "grads": grads}
    if mgr is not None:
        acc = mgr.accounting
        out.update(peak=dict(acc.peak), hidden=acc.hidden_fraction, pack_s=acc.pack_s / steps,
                   unpack_s=acc.unpack_s / steps)
        mgr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-fraction", type=float, default=0.5,
                    help="planner budget: this fraction of the keep run's activation peak (+ static terms)")
    ap.add_argument("--out", default="/tmp/moonrt-bench-memory.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = k3_tiny()
    B, T = args.batch, args.seq_len

    def run_fwd(model: K3Model, n: int) -> torch.Tensor:
        tok = _tokens(n, T, seed=n)
        return model.loss_sum(tok, tok)

    profile = traced_profile(_model, run_fwd, cfg, T)
    layout = JobLayout(seq_len=T, micro_batch_size=B, act_bytes=4)  # one micro-batch (ParallelConfig default)
    (rm,) = rank_models(cfg, layout, param_sizes(cfg), profile)
    static = sum(rm.static.values())
    from moonrt.memory.model_memory import activation_bytes

    keep_act, _ = activation_bytes(rm, profile, {}, B * T)
    budget = (static + args.budget_fraction * keep_act) / GIB
    disk = tempfile.mkdtemp(prefix="moonrt-bench-")  # each DiskStore creates its own unnamed file in it
    p = plan_memory(cfg, layout, param_sizes(cfg), Hardware(budget_gib=budget, reserve_gib=0.0, host_gib=0.0,
                                                     disk_gib=1.0, disk_gbs=2.0, tflops=0.05), profile=profile)
    planned = dict(policy_dict(p.ranks[0]), disk_path=disk, disk_capacity_mib=1024)
    policies = {
        "keep (no manager)": None,
        "keep": MemoryPolicy(),
        "recompute": policy_for_all("recompute"),
        "fp8 (matmul inputs)": from_dict(MemoryPolicy, {"rules": [{"match": m, "policy": "fp8"}
                                                                  for m in FP8_CLASSES]}),
        "disk": from_dict(MemoryPolicy, {"default": "disk", "disk_path": disk, "disk_capacity_mib": 1024,
                                         "rules": [{"match": "attn_res.sublayer_input", "policy": "disk"}]}),
        "planner": from_dict(MemoryPolicy, planned),
    }
    results = {}
    for name, pol in tqdm(policies.items(), desc="policies"):
        results[name] = run_policy(pol, B, T, args.steps)
    ref = results["keep (no manager)"]["grads"]
    base_t = results["keep (no manager)"]["step_s"]
    keep_dev = results["keep"]["peak"]["device"]
    rows = []
    print(f"k3_tiny, batch {B} x {T} tokens, {args.steps} timed steps, torch threads 1; planner budget "
          f"{budget * GIB / 2**20:.1f} MiB ({'feasible' if p.feasible else 'infeasible'}: {p.message})")
    head = f"{'policy':<22}{'step ms':>9}{'x keep':>8}{'device MiB':>12}{'vs keep':>9}{'host MiB':>10}" \
           f"{'disk MiB':>10}{'grad err':>10}"
    print(head)
    for name, r in results.items():
        num = sum(float((g - h).square().sum()) for g, h in zip(r["grads"], ref))
        den = sum(float(h.square().sum()) for h in ref)
        err = (num / den) ** 0.5
        peak = r.get("peak", {"device": float("nan"), "host": 0, "disk": 0})
        row = {"policy": name, "step_s": r["step_s"], "time_ratio": r["step_s"] / base_t,
               "peak_device_bytes": peak["device"], "peak_host_bytes": peak["host"], "peak_disk_bytes": peak["disk"],
               "device_reduction": keep_dev / peak["device"] if peak["device"] else float("inf"),
               "grad_rel_err": err, "reload_hidden": r.get("hidden")}
        rows.append(row)
        dev = f"{peak['device'] / 2**20:>12.2f}{row['device_reduction']:>8.2f}x"
        if "peak" not in r:
            dev = f"{'-':>12}{'-':>9}"
        print(f"{name:<22}{r['step_s'] * 1e3:>9.1f}{row['time_ratio']:>8.2f}{dev}{peak['host'] / 2**20:>10.2f}"
              f"{peak['disk'] / 2**20:>10.2f}{err:>10.2e}")
    with open(args.out, "w") as f:
        json.dump({"batch": B, "seq_len": T, "steps": args.steps, "planner_budget_bytes": budget * GIB,
                   "planner_choice": p.ranks[0].choice,
                   "planner_predicted_device_bytes": p.ranks[0].activations, "rows": rows}, f, indent=1)
    print(f"summary: planner chose {p.ranks[0].choice}; it predicted {p.ranks[0].activations / 2**20:.2f} MiB on "
          f"the device and {(p.ranks[0].disk + p.ranks[0].host) / 2**20:.2f} MiB offloaded; wrote {args.out}")


if __name__ == "__main__":
    main()
