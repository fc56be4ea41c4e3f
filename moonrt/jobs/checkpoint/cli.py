"""``moonrt checkpoint``: inspect, export and convert ``moonrt train`` checkpoints (job layer).

- ``moonrt checkpoint info PATH [--json] [--verify]``: step, the layout that wrote it (world, dp/pp/vpp/ep/cp,
  zero), tensor count and bytes, and what each rank passed to DCP and wrote. PATH: ``OUT/checkpoint`` (its newest
  committed step), one ``step-N`` directory (a torn one, no ``moonrt.json``, is an error), a ``checkpoint.pt``
  file, or a run directory ``OUT``: then first which checkpoint ``--resume`` takes (the newer of
  ``OUT/checkpoint.pt`` and ``OUT/checkpoint/``, :func:`moonrt.jobs.checkpoint.store.resume_state`) and that the other
  is ignored. ``--verify``: every file against the sizes and CRC-32s in ``moonrt.json`` (markers written before
  checksums: "not verified"), a ``.pt`` file's zip records against their CRC-32s. The marker's own CRC-32 and its
  step (against the ``step-N`` name) are checked on every read ("marker: CRC-32 verified"; an older marker:
  "marker: not verified").
  A missing ``OUT/checkpoint`` of a run that wrote ``OUT/checkpoint.pt`` (one process) is one line naming that
  file (give ``OUT`` or the file; ``convert`` writes the sharded format).
- ``moonrt checkpoint export DIR FILE [--names hf|moonrt] [--mxfp4] [--force]``: the model weights as one single-process
  ``safetensors`` file (no optimizer state), for use outside moonrt. DIR: as ``info``'s PATH (a run directory:
  the checkpoint ``--resume`` takes). FILE must be new (``--force`` replaces a
  user's file); a run's checkpoint is never written (the source, any ``checkpoint.pt``, a path inside a sharded
  checkpoint), not even with ``--force``. Names (``--names hf``, the default)
  follow the Llama / DeepSeek-V3 convention where moonrt has the same tensor, see :data:`HF_RULES`:

  ======================================  ======================================================
  moonrt                                  safetensors (HF-style)
  ======================================  ======================================================
  ``embed.weight``                        ``model.embed_tokens.weight``
  ``norm.weight``                         ``model.norm.weight``
  ``lm_head.weight``                      ``lm_head.weight``
  ``layers.i.attn_norm.weight``           ``model.layers.i.input_layernorm.weight``
  ``layers.i.ffn_norm.weight``            ``model.layers.i.post_attention_layernorm.weight``
  ``layers.i.ffn.{gate,up,down}_proj.*``  ``model.layers.i.mlp.{gate,up,down}_proj.*`` (dense FFN)
  ``layers.i.attn.{q_a,q_b,kv_b,o}_proj`` ``model.layers.i.self_attn.{q_a,q_b,kv_b,o}_proj`` (MLA layers)
  ``layers.i.attn.kv_a_proj.weight``      ``model.layers.i.self_attn.kv_a_proj_with_mqa.weight`` (MLA)
  ``layers.i.attn.{q_a,kv_a}_norm.weight````model.layers.i.self_attn.{q_a,kv_a}_layernorm.weight`` (MLA)
  ``layers.i.moe.router.weight``          ``model.layers.i.mlp.gate.weight``
  ``layers.i.moe.router.bias`` (buffer)   ``model.layers.i.mlp.gate.e_score_correction_bias``
  ``layers.i.moe.experts.w_gate [E,F,L]`` ``model.layers.i.mlp.experts.e.gate_proj.weight [F, L]`` per expert
  ``layers.i.moe.experts.w_up [E,F,L]``   ``model.layers.i.mlp.experts.e.up_proj.weight [F, L]``
  ``layers.i.moe.experts.w_down [E,L,F]`` ``model.layers.i.mlp.experts.e.down_proj.weight [L, F]``
  ======================================  ======================================================

  Everything else keeps its moonrt name (KDA attention, the LatentMoE's latent ``down_proj`` / ``up_proj`` /
  ``norm`` -- the routed experts act on the latent width L, not the hidden size --, the shared experts, the
  AttnRes queries). The file's ``__metadata__`` holds ``moonrt_names`` (JSON: every exported name -> its moonrt
  name, experts as ``name[e]``), the step and the model config, so :func:`from_hf` maps it back.
  ``--names moonrt`` writes the moonrt names and stacked experts unchanged. ``--mxfp4``: the weights QAT quantizes
  as packed MXFP4 codes and E8M0 scales (names, dtypes and the loader: :mod:`moonrt.jobs.checkpoint.mxfp4`).
- ``moonrt checkpoint export DIR OUT --format hf [--mxfp4] [--multimodal] [--release-dtypes] [--max-shard-size 5GB]``:
  the released Kimi K3 Hugging Face layout (K3 checkpoints): ``config.json`` in the released schema,
  safetensors shards of at most ``--max-shard-size`` bytes and ``model.safetensors.index.json`` in the new or
  empty directory OUT, every tensor under its released name and shape in the checkpoint's dtype
  (``--release-dtypes``: BF16, F32 where the release keeps F32) (:mod:`moonrt.models.k3.hf_adapter`,
  :mod:`moonrt.jobs.checkpoint.hf`); ``--mxfp4``: the routed experts as ``weight_packed`` / ``weight_scale``
  pairs with the job's ``qat_block`` (the release's scope: routed experts only) and the config's
  ``quantization_config``. ``moonrt train --init-from OUT`` reads it back.
- ``moonrt checkpoint convert SRC DST [--force]`` (SRC: as ``info``'s PATH; a run directory gives the checkpoint
  ``--resume`` takes): ``checkpoint.pt`` -> a sharded directory (DST a new or empty
  directory, used as the ``OUT/checkpoint`` root; written in one process) or a sharded directory -> a ``.pt``
  file (DST new; ``--force`` replaces an existing one, never a ``checkpoint.pt`` or a file inside a sharded
  checkpoint); AdamW and Muon jobs (``--optimizer muon``) alike.

Bad input (a malformed or unsafe checkpoint included): one line on stderr naming the argument or file, exit 2,
nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from moonrt.jobs.checkpoint.job import JobBuilder
from moonrt.models.k3.export_names import HF_RULES, from_hf, hf_names, to_hf  # noqa: F401 (re-exported)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="step, layout, tensor count and bytes of a checkpoint; which one --resume takes")
    info.add_argument("dir", metavar="PATH", help="a run directory OUT (says which checkpoint --resume takes), "
                      "OUT/checkpoint (newest committed step), a step-N directory, or a checkpoint.pt file")
    info.add_argument("--json", action="store_true", help="print the commit marker (without the job config) as JSON")
    info.add_argument("--verify", action="store_true", help="check every file against the sizes and CRC-32s in "
                      "moonrt.json (a checkpoint.pt: its zip records' CRC-32s)")
    exp = sub.add_parser("export", help="model weights as one single-process safetensors file")
    exp.add_argument("dir", metavar="DIR", help="a run directory OUT (the checkpoint --resume takes), "
                     "OUT/checkpoint (newest committed step), a step-N directory, or a checkpoint.pt file")
    exp.add_argument("file", metavar="FILE", help="the .safetensors file to write (a new file; see --force); with "
                     "--format hf a new or empty directory")
    exp.add_argument("--names", choices=("hf", "moonrt"), default="hf",
                     help="hf: HF-style names where they exist, experts one tensor each (default); moonrt: as stored")
    exp.add_argument("--force", action="store_true", help="replace an existing FILE (never a run's checkpoint)")
    exp.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                     help="safetensors: one file FILE (default); hf: the released Kimi K3 Hugging Face layout in the "
                     "new or empty directory FILE (config.json, shards, model.safetensors.index.json; K3 models)")
    exp.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                     help="--format hf: the most bytes a shard holds (5GB, 200MB, ...; a larger tensor gets its own)")
    exp.add_argument("--release-dtypes", action="store_true", help="--format hf: BF16 tensors as the release stores "
                     "them (F32: the short convs, A_log, dt_bias, KDA o_norm, router biases); default: the "
                     "checkpoint's fp32, which reads back bitwise")
    exp.add_argument("--multimodal", action="store_true", help="--format hf: the release's multimodal form (text "
                     "keys prefixed language_model., config.json's text_config inside a kimi_k3 wrapper)")
    exp.add_argument("--mxfp4", action="store_true", help="the weights QAT quantizes (the model's declared layers, "
                     "K3: the experts) as packed MXFP4 codes (<name>.weight_packed, uint8, two a byte) and E8M0 "
                     "scales (<name>.weight_scale, uint8) of the job's qat_block, decoding bitwise to the QAT "
                     "forward's weights (moonrt.jobs.checkpoint.mxfp4)")
    conv = sub.add_parser("convert", help="checkpoint.pt -> sharded directory, or sharded directory -> checkpoint.pt")
    conv.add_argument("src", metavar="SRC", help="a run directory OUT (the checkpoint --resume takes), a "
                      "checkpoint.pt file, or OUT/checkpoint / a step-N directory")
    conv.add_argument("dst", metavar="DST", help="a new or empty directory to write the sharded checkpoint into "
                      "(SRC a file), or a new .pt file (SRC a directory)")
    conv.add_argument("--force", action="store_true", help="replace an existing .pt DST (never a run's "
                      "checkpoint.pt)")


def _fail(msg: str) -> int:
    print(f"moonrt checkpoint: {msg}", file=sys.stderr)
    return 2


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _tensor_bytes(tree: Any) -> tuple[int, int]:
    """``(count, bytes)`` of the tensors in a nested dict / list."""
    import torch

    if isinstance(tree, torch.Tensor):
        return 1, tree.numel() * tree.element_size()
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else ()
    parts = [_tensor_bytes(v) for v in items]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _is_run_dir(path: Path) -> bool:
    from moonrt.jobs.checkpoint.sharded import ROOT

    return path.is_dir() and ((path / "checkpoint.pt").is_file() or (path / ROOT).is_dir())


def _existing(arg: str, flag: str) -> Path:
    """``arg`` as a path that exists, else :class:`CheckpointError`: for a missing ``OUT/checkpoint`` of a run that
    wrote ``OUT/checkpoint.pt`` (one process), which file it did write and what to give instead."""
    from moonrt.jobs.checkpoint.sharded import ROOT
    from moonrt.jobs.checkpoint.single import CheckpointError

    path = Path(arg)
    if os.path.lexists(path):
        return path
    pt = path.parent / "checkpoint.pt"
    if path.name == ROOT and pt.is_file():
        raise CheckpointError(f"{path} does not exist; this run wrote {pt}: give {path.parent} or that file "
                              f"(the sharded format: moonrt checkpoint convert {pt} {path})")
    raise CheckpointError(f"{flag} = {arg!r}: does not exist; expected a run directory OUT, OUT/checkpoint, a "
                          "step-N directory or a checkpoint.pt file")


def _info_file(path: Path, args: argparse.Namespace, extra: dict[str, Any] | None = None,
               lead: tuple[str, ...] = ()) -> int:
    import zipfile

    from moonrt.jobs.checkpoint.single import load

    state = load(path)
    if args.verify:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        if bad is not None:
            return _fail(f"checkpoint {str(path)!r}: record {bad!r} is damaged (its CRC-32 does not match)")
    n, size = _tensor_bytes(state["model"])
    m, osize = _tensor_bytes(state["optimizer"])
    cfg = state["config"]
    steps = cfg.get("optim", {}).get("steps") if isinstance(cfg.get("optim"), dict) else None
    if args.json:
        print(json.dumps({**(extra or {}), "file": str(path), "step": state["step"], "model_tensors": n,
                          "model_bytes": size, "optimizer_tensors": m, "optimizer_bytes": osize}, indent=1))
        return 0
    for line in lead:
        print(line)
    print(f"checkpoint {path} (one file)")
    print(f"step {state['step']} of {steps}; model {cfg.get('model')}")
    print(f"model {n} tensors, {_mb(size)}; optimizer {m} tensors, {_mb(osize)}")
    if args.verify:
        print("verified: every zip record matches its CRC-32")
    return 0


def _info_dir(step_dir: Path, args: argparse.Namespace, extra: dict[str, Any] | None = None,
              lead: tuple[str, ...] = ()) -> int:
    """Print a committed step directory (``extra``: more JSON fields, ``lead``: lines printed first, once it has
    been read and verified)."""
    from moonrt.jobs.checkpoint.sharded import read_marker, verified, verify

    marker = read_marker(step_dir)
    checked = verify(step_dir) if args.verify else None
    if args.json:
        print(json.dumps({**(extra or {}), "dir": str(step_dir), **{k: v for k, v in marker.items()
                                                                     if k != "config"}}, indent=1))
        return 0
    lay, ranks = marker["layout"], marker["ranks"]
    cfg = marker["config"]
    for line in lead:
        print(line)
    print(f"checkpoint {step_dir} (committed)")
    model = cfg["model"] if cfg.get("model_config") is None else "custom"
    print(f"step {marker['step']} of {cfg['optim']['steps']}; model {model}")
    print(f"written at world {lay['world']} = dp {lay['dp']} x pp {lay['pp']} x ep {lay['ep']} x cp {lay['cp']} "
          f"(vpp {lay['vpp']}, zero {lay['zero']})")
    print(f"{marker['tensors']} tensors, {_mb(marker['bytes'])}")
    for r, row in enumerate(ranks):
        print(f"rank {r}: model {_mb(row['model_bytes'])} + optimizer {_mb(row['optimizer_bytes'])} passed to DCP, "
              f"{_mb(row['written_bytes'])} written")
    print("marker: CRC-32 verified" if verified(marker) else "marker: not verified (written before marker checksums)")
    if "files" not in marker:
        print("checksums: not verified (written before checksums)")
    elif args.verify:
        print(f"checksums: {checked} files verified (size and CRC-32)")
    else:
        print(f"checksums: {len(marker['files'])} files recorded (--verify checks them)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from moonrt.jobs.checkpoint.sharded import ROOT, read_marker, resolve
    from moonrt.jobs.checkpoint.single import CheckpointError, load
    from moonrt.jobs.checkpoint.store import resume_state

    path = _existing(args.dir, "PATH")
    if path.is_file():
        return _info_file(path, args)
    if not _is_run_dir(path):
        return _info_dir(resolve(path), args)
    src, state = resume_state(path)  # the rule --resume follows: the newer by step, the sharded one on a tie
    pt, root = path / "checkpoint.pt", path / ROOT
    other: tuple[Path, int | None] | None = None  # the checkpoint --resume ignores (step None: none committed)
    if src == pt and root.exists():
        try:
            step_dir = resolve(root)
            other = (step_dir, read_marker(step_dir)["step"])
        except CheckpointError:
            other = (root, None)
    elif src != pt and pt.is_file():
        other = (pt, load(pt)["step"])
    extra = {"run": str(path), "resume_takes": str(src),
             "ignored": None if other is None else {"path": str(other[0]), "step": other[1]}}
    lead = [f"run {path}: --resume takes {src} (step {state['step']})"]
    if other is not None and other[1] is None:
        lead.append(f"{other[0]} holds no committed checkpoint: --resume ignores it")
    elif other is not None:
        lead.append(f"{other[0]} (step {other[1]}) is not newer: --resume ignores it")
    return (_info_file if src == pt else _info_dir)(src, args, extra, tuple(lead))


def _export_source(arg: str) -> tuple[Path, dict[str, Any] | None]:
    """The checkpoint ``export`` reads for its DIR argument and, for a ``checkpoint.pt`` that had to be read to
    choose it, its state: a run directory ``OUT`` gives the one ``--resume`` takes (the newer of
    ``OUT/checkpoint.pt`` and ``OUT/checkpoint/``), ``OUT/checkpoint`` its newest committed step, a file or a step
    directory themselves."""
    from moonrt.jobs.checkpoint.sharded import resolve
    from moonrt.jobs.checkpoint.store import resume_state

    path = _existing(arg, "DIR")
    if path.is_dir() and _is_run_dir(path):
        src, state = resume_state(path)
        return src, state if src.is_file() else None
    return (resolve(path) if path.is_dir() else path), None  # OUT/checkpoint: its newest committed step


def _model_state(src: Path, state: dict[str, Any] | None = None) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """``(model state dict, step, job config)`` of a checkpoint directory or ``checkpoint.pt`` file (``state``:
    the file's, already read)."""
    from moonrt.jobs.checkpoint.sharded import read_full
    from moonrt.jobs.checkpoint.single import load

    if src.is_file():
        state = state if state is not None else load(src)
        return state["model"], state["step"], state["config"]
    flat, marker = read_full(src)
    return {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}, marker["step"], marker["config"]


def _own_checkpoint(target: Path, src: Path) -> str | None:
    """Why writing ``target`` would overwrite a run's checkpoint (None if it would not): the source itself, a file
    named ``checkpoint.pt``, or a path inside a sharded checkpoint: a step directory (``step-N``, ``*.tmp``, or
    one holding ``moonrt.json`` / ``.metadata``), SRC (a directory), or a root: a directory named ``checkpoint``
    holding a ``step-N`` directory, as ``OUT/checkpoint`` is."""
    from moonrt.jobs.checkpoint.sharded import MARKER, METADATA, ROOT, STEP_DIR

    def same(a: Path, b: Path) -> bool:
        return os.path.abspath(a) == os.path.abspath(b) or a.resolve() == b.resolve()

    def is_root(d: Path) -> bool:
        if src.is_dir() and same(d, src):
            return True
        try:
            return d.name == ROOT and any(STEP_DIR.match(e.name) and e.is_dir() for e in d.iterdir())
        except OSError:  # unreadable: nothing we can see is ours
            return False

    if same(target, src):
        return "is SRC itself"
    if target.name == "checkpoint.pt":
        return "is named checkpoint.pt (a run's checkpoint)"
    for parent in {*Path(os.path.abspath(target)).parents, *target.resolve().parents}:
        if (parent / MARKER).is_file() or (parent / METADATA).is_file() or STEP_DIR.match(parent.name) or (
                parent.name.endswith(".tmp") and parent.parent.name == ROOT):
            return f"is inside the sharded checkpoint {str(parent)!r}"
        if is_root(parent):
            return f"is inside the sharded checkpoint root {str(parent)!r}"
    return None


def _target(flag: str, value: str, src: Path, force: bool, pt_ok: bool) -> str | None:
    """Why file ``value`` cannot be written (None: it can): not in an existing directory, a run's own checkpoint
    (never, even with ``--force``; ``pt_ok``: a *new* ``checkpoint.pt`` may be created), or existing without
    ``--force``."""
    out = Path(value)
    if out.is_dir() or not out.parent.is_dir():
        return f"{flag} = {value!r}: expected a file path in an existing directory"
    why = _own_checkpoint(out, src)
    if why and not (pt_ok and out.name == "checkpoint.pt" and why.startswith("is named")
                    and not os.path.lexists(out)):
        return f"{flag} = {value!r}: {why}; a run's checkpoint is never overwritten (not even with --force)"
    if os.path.lexists(out) and not force:
        return f"{flag} = {value!r}: the file exists; not overwritten (--force replaces it)"
    return None


def packed_names(name: str) -> tuple[str, str]:
    """``(packed name, scale name)`` of exported tensor ``name`` (:mod:`moonrt.jobs.checkpoint.mxfp4`)."""
    if name.endswith(".weight"):
        return name + "_packed", name + "_scale"
    return name + ".weight_packed", name + ".weight_scale"


def pack_mxfp4(tensors: dict[str, Any], back: dict[str, str], quantized: set[str], scheme: Any
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Replace every export tensor whose moonrt name (``back[name]``, an expert index ``[e]`` dropped) is in
    ``quantized`` by its packed MXFP4 codes and E8M0 scales (``scheme``: a :class:`moonrt.ops.qat.QATScheme`, its
    :meth:`~moonrt.ops.qat.QATScheme.quantize_weight`, what the QAT forward decodes); returns the new tensors and
    the ``moonrt_mxfp4`` metadata (names, dtypes and layout: :mod:`moonrt.jobs.checkpoint.mxfp4`)."""
    out: dict[str, Any] = {}
    table: dict[str, list[Any]] = {}
    for name, t in tensors.items():
        if re.sub(r"\[\d+\]$", "", back[name]) not in quantized:
            out[name] = t
            continue
        scheme.check_axis(t.shape[-1], name)
        q = scheme.quantize_weight(t.float())
        p, s = packed_names(name)
        out[p], out[s] = q.codes, q.scales
        table[name] = [p, s, list(t.shape)]
    return out, {"block": scheme.block, "scale_mode": scheme.scale_mode, "element": "e2m1", "tensors": table}


def _pack_mxfp4(tensors: dict[str, Any], back: dict[str, str], config: dict[str, Any], builder: JobBuilder
                ) -> tuple[dict[str, Any], dict[str, Any]] | str:
    """``export --mxfp4``: the tensors with the declared quantizable weights packed and the ``moonrt_mxfp4``
    metadata (:func:`pack_mxfp4`), or why not (one line)."""
    from moonrt.config import ConfigError
    from moonrt.ops.qat import QATScheme

    try:
        job = builder.read({**config, "qat": "none"})  # the block is checked against the tensors below
        spec = job.model_spec()
        if spec.qat_weights is None:
            return (f"--mxfp4: model {job.model!r} (family {spec.name!r}) declares no quantizable layers; expected a "
                    "checkpoint of a model with them (K3)")
        return pack_mxfp4(tensors, back, set(spec.qat_weights(job.model_cfg())), QATScheme(block=job.qat_block))
    except (ConfigError, ValueError) as exc:
        return f"--mxfp4: {exc}"


def _export_hf(args: argparse.Namespace, builder: JobBuilder) -> int:
    """``export --format hf``: the released Kimi K3 layout (:mod:`moonrt.jobs.checkpoint.hf`) in a new or empty
    directory; ``--mxfp4`` packs the routed experts (the release's scope) with the job's ``qat_block``."""
    import shutil

    from moonrt.config import ConfigError, umask
    from moonrt.jobs.checkpoint.hf import export_dir, parse_size

    out = Path(args.file)
    src, state = _export_source(args.dir)
    if args.names != "hf":
        return _fail("--names moonrt: expected the default (hf) with --format hf (the released names)")
    if out.exists() and not out.is_dir():
        return _fail(f"FILE = {args.file!r}: is a file; expected a new or empty directory with --format hf")
    if out.is_dir() and (held := sorted(d.name for d in out.iterdir())):
        return _fail(f"FILE = {args.file!r}: not empty (holds {held[:5]}{' ...' if len(held) > 5 else ''}); "
                     "--format hf writes only into a new or empty directory")
    if why := _own_checkpoint(out, src):
        return _fail(f"FILE = {args.file!r}: {why}; a run's checkpoint is never overwritten")
    if not out.parent.is_dir():
        return _fail(f"FILE = {args.file!r}: expected a directory path in an existing directory")
    try:
        max_bytes = parse_size(args.max_shard_size)
        model, step, config = _model_state(src, state)
        job = builder.read({**config, "qat": "none"})
        if job.model_spec().name != "k3":
            return _fail(f"--format hf: model {job.model!r} (family {job.model_spec().name!r}); expected a K3 "
                         "checkpoint (the released Kimi K3 layout)")
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))  # renamed when whole
        try:
            os.chmod(tmp, 0o777 & ~umask())  # the mode mkdir would give, not mkdtemp's 0700
            files, n, size = export_dir(tmp, model, job.model_cfg(), mxfp4_block=job.qat_block if args.mxfp4
                                        else None, multimodal=args.multimodal, max_shard_bytes=max_bytes,
                                        metadata={"moonrt_step": str(step)}, release_dtypes=args.release_dtypes)
            if out.is_dir():
                out.rmdir()  # empty (checked above); a file appearing meanwhile makes this fail, nothing replaced
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    except OSError as exc:  # a full disk (ENOSPC), a quota: the temporary directory (ours) was removed
        return _fail(f"FILE = {args.file!r}: cannot write the Hugging Face directory ({exc.strerror or exc}); "
                     "nothing written")
    except (ConfigError, ValueError, KeyError) as exc:
        msg = str(exc).strip("'\"")
        if "MXFP4 block" in msg:
            msg = f"--mxfp4: {msg} (the checkpoint's qat_block; a k3_tiny job takes --qat-block 8)"
        return _fail(msg)
    print(f"wrote {out}: {n} tensors in {len(files)} shards, {_mb(size)} (step {step} from {src}, the released "
          f"Kimi K3 layout{', MXFP4 routed experts' if args.mxfp4 else ''})")
    return 0


def _export(args: argparse.Namespace, builder: JobBuilder) -> int:
    from safetensors.torch import save

    if args.format == "hf":
        return _export_hf(args, builder)

    from moonrt.config import umask
    from moonrt.jobs.checkpoint.single import publish

    out = Path(args.file)
    src, state = _export_source(args.dir)
    if refused := _target("FILE", args.file, src, args.force, pt_ok=False):
        return _fail(refused)
    model, step, config = _model_state(src, state)
    if args.names == "hf":
        tensors, back = to_hf(model)
    else:
        tensors, back = {k: v.contiguous() for k, v in model.items()}, {k: k for k in model}
    meta = {"format": "pt", "moonrt_step": str(step), "moonrt_names": json.dumps(back),
            "moonrt_config": json.dumps(config)}
    if args.mxfp4:
        packed = _pack_mxfp4(tensors, back, config, builder)
        if isinstance(packed, str):
            return _fail(packed)
        tensors, meta["moonrt_mxfp4"] = packed[0], json.dumps(packed[1])
    data = save(tensors, metadata=meta)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)  # a new file of ours
    try:
        with os.fdopen(fd, "wb") as f:  # written through the descriptor: the name is never reopened
            os.fchmod(f.fileno(), 0o666 & ~umask())  # the mode open() would give, not mkstemp's 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, out, exclusive=not args.force)
    except FileExistsError:
        return _fail(f"FILE = {args.file!r}: the file exists; not overwritten (--force replaces it)")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    print(f"wrote {out}: {len(tensors)} tensors, {_mb(sum(t.numel() * t.element_size() for t in tensors.values()))} "
          f"(step {step} from {src}, {args.names} names{', MXFP4 packed experts' if args.mxfp4 else ''})")
    return 0


def _convert(args: argparse.Namespace, builder: JobBuilder) -> int:
    from moonrt.jobs.checkpoint.sharded import save_sharded, to_single_file
    from moonrt.jobs.checkpoint.single import CheckpointError, load, save

    src, dst = _existing(args.src, "SRC"), Path(args.dst)
    state = None
    if _is_run_dir(src):  # a run directory OUT: the checkpoint --resume takes, as info and export read it
        from moonrt.jobs.checkpoint.store import resume_state

        src, state = resume_state(src)
        state = state if src.is_file() else None
    if src.is_dir():
        if refused := _target("DST", args.dst, src, args.force, pt_ok=True):
            return _fail(refused)
        state = to_single_file(src, builder)
        save(dst, state, exclusive=not args.force or dst.name == "checkpoint.pt")  # a new one only
        print(f"wrote {dst}")
        return 0
    if dst.exists() and not dst.is_dir():
        return _fail(f"DST = {args.dst!r}: is a file; expected a new or empty directory to write the sharded "
                     "checkpoint into")
    if dst.is_dir() and (held := sorted(d.name for d in dst.iterdir())):
        return _fail(f"DST = {args.dst!r}: not empty (holds {held[:5]}{' ...' if len(held) > 5 else ''}); convert "
                     "writes only into a new or empty directory")
    import torch

    from moonrt.config import ConfigError
    from moonrt.ops.muon import Muon

    state = state if state is not None else load(src)
    try:
        job = builder.read(state["config"])
        model = builder.model(job)
        opt = builder.optimizer(model, job)
        if not isinstance(opt, torch.optim.AdamW | Muon):
            return _fail(f"SRC = {args.src!r}: optimizer {type(opt).__name__}; expected AdamW or Muon (the sharded "
                         "format's states)")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (ConfigError, RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {args.src!r}: does not hold the model and optimizer of its own config: "
                              f"{type(exc).__name__}: {first[:300]}") from None
    print(f"wrote {save_sharded(dst, model, opt, state['step'], job)}")
    return 0


def run(args: argparse.Namespace, builder: JobBuilder) -> int:
    """Run ``args.action``; ``builder``: the job layer's (``moonrt/cli.py`` passes
    :data:`moonrt.jobs.train.resume.BUILDER`), for the actions that rebuild a checkpoint's model (``export``,
    ``convert``)."""
    from moonrt.jobs.checkpoint.single import CheckpointError

    try:
        if args.action == "info":
            return _info(args)
        return {"export": _export, "convert": _convert}[args.action](args, builder)
    except (CheckpointError, OSError) as exc:
        return _fail(str(exc).splitlines()[0])
