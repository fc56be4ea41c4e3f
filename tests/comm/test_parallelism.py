"""The composable parallelism object: defaults of a one-process job and how parts take over verbs."""

from __future__ import annotations

import torch
from torch import nn

from moonrt.comm.parallelism import Parallelism, Part


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model(torch.randn(3, 4)).square().sum().mul(100).backward()
    return model


def test_no_parts_is_the_single_process_loop() -> None:
    rt, ref = Parallelism(), _model_with_grads()
    model = _model_with_grads()
    assert rt.parallelize(model) is model
    rt.sync_grads(model)  # no replicas: gradients untouched
    norm = rt.clip_grad_norm(model.parameters(), 1.0)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    assert norm == ref_norm and norm > 1.0
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert rt.sum_scalar(2.5) == 2.5
    opt = torch.optim.AdamW(model.parameters())
    state = rt.full_state_dict(model, opt)
    assert state["model"].keys() == model.state_dict().keys()


def test_first_part_that_handles_a_verb_wins_and_hooks_run_in_order() -> None:
    calls: list[str] = []

    class Owner(Part):
        def sync_grads(self, model: nn.Module, reduce_dtype: torch.dtype = torch.float32) -> bool:
            calls.append("owner.sync")
            return True

        def clip_grad_norm(self, params, max_norm):
            calls.append("owner.clip")
            return 7.0

        def step_metrics(self, step, model, record):
            record["owner"] = step

    class Later(Part):
        def sync_grads(self, model: nn.Module, reduce_dtype: torch.dtype = torch.float32) -> bool:
            calls.append("later.sync")
            return True

        def clip_grad_norm(self, params, max_norm):
            calls.append("later.clip")
            return 9.0

        def step_metrics(self, step, model, record):
            record["later"] = record["owner"] + 1

    rt = Parallelism(parts=[Owner(), Later()])
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    rt.sync_grads(model)
    assert rt.clip_grad_norm(model.parameters(), 1.0) == 7.0
    assert calls == ["owner.sync", "owner.clip"]
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))  # the default clip did not run
    record: dict = {}
    rt.step_metrics(4, model, record)
    assert record == {"owner": 4, "later": 5}


class _LossModel(nn.Module):
    """The duck-typed surface the default step uses: ``loss_sum(x, y, ctx=...)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 8)

    def loss_sum(self, x: torch.Tensor, y: torch.Tensor, ctx: object = None) -> torch.Tensor:
        logits = self.out(self.emb(x))
        return nn.functional.cross_entropy(logits.reshape(-1, 8), y.reshape(-1), reduction="sum")


def test_default_step_is_one_forward_and_one_backward_and_a_part_can_run_it() -> None:
    x, y = torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]])
    model, ref = _LossModel(), _LossModel()
    loss = Parallelism().forward_backward(model, x, y, 1 / 3)
    ref_loss = ref.loss_sum(x, y) / 3
    ref_loss.backward()
    assert not loss.requires_grad and torch.allclose(loss, ref_loss.detach())
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad)
    with torch.no_grad():
        assert float(Parallelism().loss_sum(model, x, y)) == float(ref.loss_sum(x, y))

    class Runner(Part):  # e.g. the pipeline: it runs the step and eval itself
        def forward_backward(self, model, x, y, scale, ctx=None, saved=None):
            return torch.tensor(42.0)

        def loss_sum(self, model, x, y, ctx=None):
            return torch.tensor(7.0)

    rt = Parallelism(parts=[Part(), Runner()])
    model.zero_grad(set_to_none=True)
    assert float(rt.forward_backward(model, x, y, 1.0)) == 42.0 and model.out.weight.grad is None
    assert float(rt.loss_sum(model, x, y)) == 7.0


def test_step_runs_the_first_handling_part_else_the_optimizer() -> None:
    """``Parallelism.step`` (the loop's ``opt.step()``): the first part whose ``step`` returns True updates the
    parameters (ZeRO-1's sharded AdamW) and no other does; with none, ``optimizer.step()`` runs."""
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    calls: list[str] = []

    class Updater(Part):
        def __init__(self, name: str) -> None:
            self.name = name

        def step(self, optim: torch.optim.Optimizer) -> bool:
            calls.append(self.name)
            return True

    p.grad = torch.ones(3)
    Parallelism(parts=[Part(), Updater("a"), Updater("b")]).step(opt)
    assert calls == ["a"] and torch.equal(p.detach(), torch.ones(3)), "the handling part replaces optim.step()"
    Parallelism(parts=[Part()]).step(opt)
    assert torch.equal(p.detach(), torch.full((3,), 0.5))


def test_compose_orders_parts_by_the_table_and_links_what_each_wraps() -> None:
    """``compose``: whatever order the assembly built the parts in, they come out in COMPOSITION's order and each
    wrapping part holds the first present part of the kinds its row wraps; an unknown or repeated kind is an error."""
    import pytest

    from moonrt.comm.compose import COMPOSITION, compose

    def make(kind: str) -> Part:
        return type(f"P_{kind}", (Part,), {"kind": kind})()

    pipe, zero, expert, trace = (make(k) for k in ("pipeline", "zero", "expert", "trace"))
    assert [r.kind for r in COMPOSITION] == ["pipeline", "zero", "expert", "trace"]
    assert compose([trace, expert, zero, pipe]) == [pipe, zero, expert, trace]
    assert pipe.inner is zero and zero.inner is expert and expert.inner is None
    pipe2, expert2 = make("pipeline"), make("expert")
    assert compose([expert2, pipe2]) == [pipe2, expert2] and pipe2.inner is expert2
    with pytest.raises(ValueError, match=r"kind = 'other': expected one of pipeline, zero, expert, trace"):
        compose([make("other")])
    with pytest.raises(ValueError, match=r"kind = 'zero': expected one part per kind"):
        compose([make("zero"), make("zero")])


def test_one_clip_sums_terms_per_group_and_scales_like_torch() -> None:
    """``clip_to_global_norm`` in one process (groups of one rank: no sum): the norm is the square root of the
    summed terms and the gradients are scaled by torch's rule (``max_norm / (norm + 1e-6)`` when below 1)."""
    from moonrt.comm.parallelism import GradNorm, clip_to_global_norm

    grads = [torch.full((3,), 2.0), torch.full((2, 2), 1.0)]
    sq = [g.double().pow(2).sum() for g in grads]
    norm = clip_to_global_norm(GradNorm([(sq[0], ()), (sq[1], (None,))], grads), 1.0)
    assert norm == 4.0  # sqrt(12 + 4)
    assert torch.equal(grads[0], torch.full((3,), 2.0 * (1.0 / (4.0 + 1e-6))))
    same = [torch.full((3,), 2.0)]
    assert clip_to_global_norm(GradNorm([(same[0].double().pow(2).sum(), ())], same), 10.0) == 12 ** 0.5
    assert torch.equal(same[0], torch.full((3,), 2.0)), "below max_norm: untouched"


def _max_ints_rank(rank: int, world: int) -> tuple[list[int], bool, bool]:
    rt = Parallelism()
    big = (1 << 40) + rank  # int64: peak memory in bytes does not fit int32
    return rt.max_ints([rank, 7 - rank, big]), rt.any_flag(rank == 2), rt.any_flag(False)


def test_max_ints_and_any_flag_agree_on_every_rank() -> None:
    """One all-reduce MAX of several int64 values (the loop's stop vote and the largest peak memory of the ranks):
    every rank gets the elementwise maximum; any_flag is its one-value case."""
    from dist import dist_run

    res = dist_run(_max_ints_rank, 3)
    assert all(r == ([2, 7, (1 << 40) + 2], True, False) for r in res), res
    assert Parallelism().max_ints([3, -1]) == [3, -1]  # one process: the values themselves
