"""Host synchronizations per training step (issue 47 item 5), counted on CPU by ``tests/host_syncs.py``.

The counter records what moonrt's own frames call that waits for the GPU on CUDA (``.item()``, ``int()`` /
``float()`` / ``bool()`` of a tensor, ``.tolist()``, ``.cpu()``, ``torch.tensor(list, device=...)``). One k3_tiny step
is the difference between a 3-step and a 2-step run (same evaluation and checkpoint at the end of each), so set-up,
evaluation and saving cancel.

:data:`MAX_SYNCS_PER_STEP`: the figure after the cuts of issue 47 (92 before: validation ``min``/``max`` read twice,
the histogram's token count read twice per MoE layer, ``maxvio`` read twice, the KDA sub-tile's ``aminmax`` read as
two floats). What remains, per k3_tiny step (4 blocks of KDA + MoE layers, 8 MoE layer calls): per MoE layer one
validation read of the router's ids (``dispatch``), the grouped GEMM's row bounds (``cu_seqlens.tolist()``: the
split sizes are host integers by design), one copy of the step's routing counts to the host and the host reads of
it; per KDA call the decay validation and clamp checks and the sub-tile choice; per step the token-range check, the
loss and the gradient norm (metrics and the divergence check). Reads of tensors already on the host (the routing
counts copied once) count here too, though they wait for nothing on a GPU.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from host_syncs import _MOONRT, HostSyncCounter
from jobs.helpers import _corpus

from moonrt.cli import main
from moonrt.jobs.train import device

MAX_SYNCS_PER_STEP = 61
"""Host synchronizations one k3_tiny step makes from moonrt's frames (benchmarks/RESULTS.md: 92 before, 61 after)."""


def test_counter_counts_moonrt_frames_only() -> None:
    """Each kind counts once per call made from a moonrt file; the same calls from elsewhere (this test) do not."""
    t = torch.tensor([3.0, 4.0])
    src = ("a = t.sum().item(); b = int(t[0]); c = float(t[1]); d = bool(t[0] > 1); e = t.tolist(); f = t.cpu()\n"
           "g = t.to('cpu'); h = t.to(torch.device('cpu')); i = torch.tensor([1, 2], device='cpu')\n"
           "j = torch.tensor([1, 2]); k = t.numpy()\n")
    code = compile(src, f"{_MOONRT}/fake_module.py", "exec")
    with HostSyncCounter() as c:
        exec(code, {"t": t, "torch": torch})
        t.sum().item(), int(t[0]), t.tolist(), t.cpu()  # this file's: not counted
    kinds = collections.Counter()
    for (kind, where), n in c.counts.items():
        assert where.startswith("moonrt/fake_module.py:"), where
        kinds[kind] += n
    assert kinds == {"item": 1, "scalar": 3, "tolist": 1, "d2h": 2, "h2d": 1}, kinds
    assert c.total == 8


def _run(tmp_path: Path, steps: int) -> collections.Counter:
    out = tmp_path / f"run{steps}"
    with HostSyncCounter() as c:
        assert main(["train", "--corpus", str(_corpus(tmp_path)), "--batch-size", "2", "--seq-len", "16",
                     "--steps", str(steps), "--eval-every", "100", "--set", "optim.checkpoint_every=100",
                     "--out", str(out), "--no-progress"]) == 0
    return c.counts


@pytest.mark.slow
def test_k3_tiny_step_host_syncs_within_the_budget(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    with torch.random.fork_rng(devices=[]):
        two, three = _run(tmp_path, 2), _run(tmp_path, 3)
    capsys.readouterr()
    step = three - two
    assert not two - three  # nothing happens less often in the longer run
    per_step = sum(step.values())
    table = "\n".join(f"{n:4d} {kind:6s} {where}" for (kind, where), n in step.most_common())
    assert per_step <= MAX_SYNCS_PER_STEP, f"{per_step} host syncs per k3_tiny step > {MAX_SYNCS_PER_STEP}:\n{table}"
