"""``moonrt train --cp 2`` on 2 ranks (``helpers._ranks``) trains like the single process (K3_SYSTEMS §7), and so
does ``--ep 2 --cp 2`` on 4 ranks (CP composed with MoonEP).

Both runs see the same global batch every step (the batch is a function of seed and step); with CP each
sequence is split over the two ranks (KCP for KDA layers, latent all-gather for MLA layers), gradients are
summed over the ranks. What this test is for: the bytes each CP rank sends per step are exactly KCP's
summaries plus the halo and MLA's latent slices (no activation all-gather), and the first steps' losses
agree within 1e-4 relative. Exact parity (1e-5 on loss, parameters and moments) is the teacher-forced test in
``tests/jobs/test_compose_train.py``. The run is short and keeps the comparison well-conditioned: KCP
changes the fp32 summation order (~1e-7 relative), and MoE training amplifies such differences through
discrete decisions (QB's histogram estimator moves the bias by up to a bin width when a margin crosses a
bin edge; a top-k near-tie flips one token's expert), so the QB bias update is off and ``--lr`` is 1e-3.
Both CP runs move KCP's summaries over the shm heap (``parallel.cp_transport: auto`` on CPU ranks of one host; the
heap against the collectives, bitwise: ``tests/jobs/test_cp_heap_train.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jobs.helpers import _cli, _here, _ranks, _run

from moonrt.models.k3.model.config import k3_tiny

STEPS = 5
FLAGS = ["--steps", str(STEPS), "--seed", "0", "--batch-size", "2", "--seq-len", "48", "--eval-every", "100",
         "--lr", "1e-3", "--threads", "1", "--no-progress"]


def _moonrt(*args: str) -> list[str]:
    return [sys.executable, "-m", "moonrt.cli", *args]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_training_matches_single_process_loss_curve(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    config = tmp_path / "job.yaml"
    config.write_text("optim:\n  routing_bias_update: false\n")
    flags = [*FLAGS, "--config", str(config)]
    single = _here("train", *flags, "--metrics", str(a), "--out", str(tmp_path / "ra"))  # the reference: here
    cp = _ranks(2, "train", "--cp", "2", *flags, "--metrics", str(b), "--out", str(tmp_path / "rb"))
    c = tmp_path / "c.jsonl"  # CP composed with MoonEP: 4 ranks = ep 2 x cp 2 (batch rows over EP, sequences over CP)
    ep_cp = _ranks(4, "train", "--ep", "2", "--cp", "2", *flags, "--metrics", str(c), "--out", str(tmp_path / "rc"))
    _run(tmp_path, {"single": single, "cp2": cp, "ep2_cp2": ep_cp}, timeout=540)
    ra = [json.loads(line) for line in a.read_text().splitlines()]
    rb = [json.loads(line) for line in b.read_text().splitlines()]
    rc = [json.loads(line) for line in c.read_text().splitlines()]
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [r["step"] for r in rc] == list(range(1, STEPS + 1))
    for x, y, z in zip(ra, rb, rc):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
        assert abs(x["loss"] - z["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], z["loss"])
    for r in (rb, rc):
        assert abs(ra[-1]["eval_loss"] - r[-1]["eval_loss"]) <= 1e-4 * ra[-1]["eval_loss"]
        assert all(y["cp_transport"] == "shm" for y in r)  # parallel.cp_transport auto: CPU ranks of one host
    # rank 0's bytes sent per step (K3_SYSTEMS §7): per KDA layer the KCP summary B*H*K*(K+V)*4 in each pass
    # plus the 3-token halo to rank 1; per MLA layer its latent slice and, in backward, rank 1's latent gradient.
    cfg = k3_tiny()
    lac = cfg.linear_attn_config
    H, K, bsz, t_r = lac.num_heads, lac.head_dim, 2, 24
    kinds = cfg.layer_types()
    kda = 2 * bsz * H * K * (K + K) * 4 + (lac.short_conv_kernel_size - 1) * bsz * 3 * H * K * 4
    mla = 2 * t_r * bsz * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert all(y["cp_bytes_sent"] == kinds.count("kda") * kda + kinds.count("mla") * mla for y in rb)


def test_cp_degree_that_does_not_fit_the_world_is_a_clear_error(tmp_path: Path, capfd) -> None:
    """Refused before a job starts: in this process (``_cli``), not a new interpreter's imports."""
    code, out, err = _cli(["train", "--cp", "2", "--steps", "1", "--no-progress", "--out", str(tmp_path)], capfd)
    assert code == 2, out + err
    assert "ranks per data-parallel replica: expected a divisor of the world size 1" in err, err
