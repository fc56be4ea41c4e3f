"""Resources of the Triton KDA kernels compiled for sm_90 (H100/H200) without a GPU: shared memory per block,
registers per thread, spilled bytes and compile seconds, per kernel and head_dim (K = V), chunk 64.

Each (kernel, head_dim) compiles in its own subprocess (without ``TRITON_INTERPRET``, with an empty Triton cache)
through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` with the constexprs, warps and stages
the host wrappers (:mod:`moonrt.ops.kda.backends.triton`) launch with; registers and spills are read from the
cubin with the ``cuobjdump --dump-resource-usage`` that Triton ships (``stack``: the per-thread local frame, i.e.
spilled bytes; ``mma``: the PTX holds tensor-core instructions). Prints a table and writes JSON::

    python benchmarks/gpu/kda_sm90_resources.py --head-dims 64 96 128 --json kda_sm90.json

``--kernels-file`` compiles the kernels of another copy of ``triton_kernels.py`` (e.g. the previous commit's, for a
before/after table). The CI compile check of every kernel is ``benchmarks/gpu/sm90.py``; this script is the KDA
kernels' quick measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

SM90_SHARED_LIMIT = 232_448
"""Shared memory a block may use on sm_90 (227 KiB)."""


def _configs(D: int, old: bool) -> dict[str, tuple[dict[str, str], dict[str, object], dict[str, int]]]:
    """Per kernel: (pointer/int signature, constexprs, launch options) as the host wrappers launch it (fp32 compute,
    bf16 token tensors)."""
    import triton.language as tl

    from moonrt.ops.kda.backends import triton as kt

    C = 64
    kp = max(16, 1 << (D - 1).bit_length())
    bk = kp if old else kt.block_for(D)
    bv_state = min(kp, kt.STATE_V_BLOCK)  # the old kernels' value block (the current ones: per pass, below)
    tok, f32, i64 = "*bf16", "*fp32", "*i64"
    ints = {"H": "i32", "K": "i32", "V": "i32"}
    common = {"DT": tl.float32} if old else {"DT": tl.float32, "PREC": kt.FP32_DOT}
    chunk_opts = {} if old else {"num_warps": kt.CHUNK_WARPS}
    state_opts = {"num_stages": kt.STATE_PASS_STAGES, "num_warps": kt.STATE_WARPS}  # the transition's
    scan_opts = state_opts if old else {"num_stages": kt.STATE_SCAN_STAGES, "num_warps": kt.STATE_WARPS}
    terms_sig = dict(q=tok, k=tok, v=tok, g=tok, beta=tok, chunk_bos=i64, chunk_len=i64, W=f32, U=f32, Kg=f32, Qg=f32,
                     A_qk=f32, A_kk=f32, T_inv=f32, decay=f32, scale=f32, **ints)
    if old:
        st = {"BK": kp, "BV": bv_state}
        tr = {"BK": kp, "BV": kp}
        st_bwd = st
        bwd_flags: dict[str, bool] = {}
    else:
        bks = kt.state_k_block(D)

        def state(v_block: int) -> dict[str, int]:
            return {"BKS": bks, "NKB": -(-D // bks), "BV": min(kp, kt.STATE_V_BLOCK, v_block)}

        wide = D > kt.STATE_K_BLOCK  # as triton._state_bwd
        st, tr = state(kt.STATE_FWD_V_BLOCK), state(kt.TRANSITION_V_BLOCK)
        st_bwd = state(kt.STATE_BWD_WIDE_V_BLOCK if wide else kt.STATE_BWD_V_BLOCK)
        bwd_flags = {"AQ_AS_B": wide}
    cfg = {
        "chunk_terms": (terms_sig, dict(C=C, BK=bk, BV=bk, SUB=16, HAS_Q=True, **common), chunk_opts),
        "state_fwd": (dict(W=f32, U=f32, Kg=f32, Qg=f32, A_qk=f32, decay=f32, S0=f32, S_in=f32, O=tok, S_final=f32,
                           seq_chunk0=i64, chunk_bos=i64, chunk_len=i64, **ints),
                      {"C": C, **st, "HAS_S0": True, "HAS_Q": True, "STORE_S_IN": True, **common}, scan_opts),
        "state_bwd": (dict(W=f32, Kg=f32, Qg=f32, A_qk=f32, decay=f32, dO=tok, d_final=f32, dS0=f32, dS_out=f32,
                           seq_chunk0=i64, chunk_bos=i64, chunk_len=i64, **ints),
                      {"C": C, **st_bwd, "HAS_D_FINAL": True, "STORE_DS_OUT": True, **bwd_flags, **common},
                      scan_opts),
        "transition": (dict(W=f32, U=f32, Kg=f32, decay=f32, M_out=f32, S_out=f32, seq_chunk0=i64, **ints),
                       {"C": C, **tr, **common}, state_opts),
    }
    bkg = kp if old else kt.block_for(D, kt.GRADS_MAX_BLOCK)
    if old:
        grads_sig = dict(q=tok, k=tok, v=tok, g=tok, beta=tok, chunk_bos=i64, chunk_len=i64, W=f32, U=f32, Kg=f32,
                         Qg=f32, A_qk=f32, A_kk=f32, T_inv=f32, decay=f32, S_in=f32, dS_out=f32, dO=tok, dq=tok,
                         dk_=tok, dv_=tok, dg=tok, dbeta=tok, scale=f32, **ints)
        cfg["chunk_grads"] = (grads_sig, dict(C=C, BK=bkg, BV=bkg, SUB=16, **common), chunk_opts)
        return cfg
    scratch = dict(Vt_buf=f32, dVt_buf=f32, dA_buf=f32)
    cfg["chunk_grads_v"] = (dict(v=tok, beta=tok, chunk_bos=i64, chunk_len=i64, W=f32, U=f32, Kg=f32, A_qk=f32,
                                 T_inv=f32, S_in=f32, dS_out=f32, dO=tok, g=tok, k=tok, **scratch, dv_=tok, **ints),
                            dict(C=C, BK=bkg, BV=bkg, **common), chunk_opts)
    cfg["chunk_grads_wy"] = (dict(beta=tok, chunk_bos=i64, chunk_len=i64, A_kk=f32, T_inv=f32, dA_buf=f32, dbeta=tok,
                                  H="i32"), dict(C=C, **common), chunk_opts)
    cfg["chunk_grads_k"] = (dict(q=tok, k=tok, g=tok, beta=tok, chunk_bos=i64, chunk_len=i64, T_inv=f32, S_in=f32,
                                 dS_out=f32, dO=tok, **scratch, dq=tok, dk_=tok, dg=tok, scale=f32, **ints),
                            dict(C=C, BK=bkg, BV=bkg, SUB=16, **common), chunk_opts)
    return cfg


def _compile_one(kernels_file: str | None, name: str, D: int, old: bool) -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget

    if kernels_file:
        spec = importlib.util.spec_from_file_location("kda_kernels_under_test", kernels_file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        import moonrt.ops.kda.backends.triton_kernels as mod
    sig, constexprs, opts = _configs(D, old)[name]
    fn = getattr(mod, f"{name}_kernel")
    full_sig = {a: sig.get(a, "constexpr") for a in fn.arg_names}
    t0 = time.perf_counter()
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full_sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    seconds = time.perf_counter() - t0
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ptx = compiled.asm["ptx"]
    return {"kernel": name, "head_dim": D, "shared": compiled.metadata.shared, "regs": int(regs.group(1)),
            "stack": int(stack.group(1)), "num_warps": compiled.metadata.num_warps, "compile_s": round(seconds, 1),
            "mma": bool(re.search(r"\b(mma|wgmma)\.", ptx)), "fits": compiled.metadata.shared <= SM90_SHARED_LIMIT}


def _last_error(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if x and not x.startswith(" ")]
    return (lines[-1] if lines else "failed")[:240]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128])
    ap.add_argument("--kernels", nargs="+",
                    default=["chunk_terms", "state_fwd", "state_bwd", "transition", "chunk_grads_v", "chunk_grads_wy",
                             "chunk_grads_k"],
                    help="kernel names without _kernel (--old: chunk_grads instead of the two chunk_grads_*)")
    ap.add_argument("--kernels-file", default=None, help="another copy of triton_kernels.py to compile")
    ap.add_argument("--old", action="store_true", help="the kernels-file has the previous (unblocked) signatures")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=INT",
                    help="override a tile constant of moonrt.ops.kda.backends.triton (e.g. STATE_V_BLOCK=32)")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        from moonrt.ops.kda.backends import triton as kt

        for kv in a.set:
            name, val = kv.split("=")
            setattr(kt, name, int(val))
        print(json.dumps(_compile_one(a.kernels_file, a.one[0], int(a.one[1]), a.old)))
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows = []
    for D in a.head_dims:
        for name in a.kernels:
            env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kda_sm90_")  # a cold compile each time
            cmd = [sys.executable, __file__, "--one", name, str(D)]
            if a.kernels_file:
                cmd += ["--kernels-file", a.kernels_file]
            if a.old:
                cmd.append("--old")
            if a.set:
                cmd += ["--set", *a.set]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
                row = (json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else
                       {"kernel": name, "head_dim": D, "error": _last_error(out.stderr)})
            except subprocess.TimeoutExpired:
                row = {"kernel": name, "head_dim": D, "error": f"compile over {a.timeout:.0f} s"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'kernel':<12} {'D':>4} {'shared B':>9} {'regs':>5} {'stack B':>8} {'warps':>5} {'mma':>4} "
          f"{'compile s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<12} {r['head_dim']:>4}  {r['error']}")
        else:
            print(f"{r['kernel']:<12} {r['head_dim']:>4} {r['shared']:>9} {r['regs']:>5} {r['stack']:>8} "
                  f"{r['num_warps']:>5} {str(r['mma']):>4} {r['compile_s']:>9}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"target": "cuda sm_90", "shared_limit": SM90_SHARED_LIMIT, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
