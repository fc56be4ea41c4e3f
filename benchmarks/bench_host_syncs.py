"""Host synchronizations per ``moonrt train`` step (issue 47 item 5), counted on CPU.

``tests/host_syncs.py``'s counter (what moonrt's frames call that waits for a GPU on CUDA: ``.item()``, ``int()`` /
``float()`` / ``bool()`` of a tensor, ``.tolist()``, ``.cpu()``, ``torch.tensor(list, device=...)``) around two
in-process runs of the same job, ``--steps N`` and ``N + 1`` (evaluation and checkpoint only at the end of each):
their difference is one step. Prints the count per call site and kind, and writes JSON (``--out``). The test that
holds the figure: ``tests/jobs/test_host_syncs.py``.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_host_syncs.py [--model k3_tiny] [--out /tmp/moonrt-bench/syncs.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from host_syncs import HostSyncCounter  # noqa: E402

from moonrt.cli import main as moonrt_main  # noqa: E402


def _count(corpus: Path, out: Path, model: str, steps: int) -> HostSyncCounter:
    args = ["train", "--model", model, "--corpus", str(corpus), "--batch-size", "2", "--seq-len", "16", "--steps",
            str(steps), "--eval-every", "100000", "--set", "optim.checkpoint_every=100000", "--device", "cpu",
            "--out", str(out / f"run{steps}"), "--no-progress"]
    with HostSyncCounter() as c, contextlib.redirect_stdout(io.StringIO()), torch.random.fork_rng(devices=[]):
        if moonrt_main(args) != 0:
            raise SystemExit(f"moonrt {' '.join(args)} failed")
    return c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="k3_tiny")
    parser.add_argument("--steps", type=int, default=2, help="the shorter run's steps (the longer runs one more)")
    parser.add_argument("--out", default="/tmp/moonrt-bench/host_syncs.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus.txt"
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
        short, long = _count(corpus, root, args.model, args.steps), _count(corpus, root, args.model, args.steps + 1)
    step = long.counts - short.counts
    print(f"host synchronizations per {args.model} step (moonrt frames, counted on CPU)")
    print(f"{'count':>5}  {'kind':6}  site")
    for (kind, where), n in step.most_common():
        print(f"{n:5d}  {kind:6}  {where}")
    total = sum(step.values())
    print(f"{total:5d}  total")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "per_step": total,
                               "sites": [{"kind": k, "site": w, "count": n} for (k, w), n in step.most_common()]},
                              indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
