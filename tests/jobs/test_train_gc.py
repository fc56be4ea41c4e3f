"""Manual garbage collection in the training loop (``JobConfig.gc_interval``, :class:`moonrt.jobs.train.loop.ManualGC`):
no automatic collection inside, one young-generation collection every ``gc_interval`` steps, the collector's state
restored afterwards (also when training raises)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from moonrt.config import ConfigError, from_dict
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.loop import ManualGC, train


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycles(n: int) -> weakref.ref:
    """Make ``n`` two-object reference cycles (garbage at once); returns a weak reference to the last one."""
    for _ in range(n):
        a, b = _Node(), _Node()
        a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collections():
    """Generations of the collections that start while the test runs (with the collector's enabled flag)."""
    seen: list[tuple[int, bool]] = []

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((info["generation"], gc.isenabled()))

    gc.callbacks.append(cb)
    try:
        yield seen
    finally:
        gc.callbacks.remove(cb)


def test_no_automatic_collection_inside_one_young_collection_per_interval(collections):
    assert gc.isenabled()
    ctl = ManualGC(3)
    try:
        assert not gc.isenabled()
        ref = _cycles(50_000)  # 100k container objects: ~140 automatic collections if the collector were on
        assert collections == [] and ref() is not None
        ctl.tick(1)
        ctl.tick(2)
        assert collections == [] and ref() is not None
        ctl.tick(3)
        assert collections == [(1, False)] and ref() is None  # freed by the young-generation collection
    finally:
        ctl.close()
    assert gc.isenabled()


def test_interval_zero_leaves_the_collector_alone(collections):
    ctl = ManualGC(0)
    assert gc.isenabled()
    _cycles(50_000)
    assert collections and all(enabled for _, enabled in collections)  # the automatic collector ran
    ctl.tick(50)
    ctl.close()
    assert gc.isenabled()
    gc.disable()
    try:
        ManualGC(5).close()
        assert not gc.isenabled()  # a collector the caller had turned off stays off
    finally:
        gc.enable()


def test_train_collects_every_interval_and_restores_the_collector(tmp_path: Path, collections, monkeypatch) -> None:
    opt = {"steps": 4, "batch_size": 2, "seq_len": 32, "warmup_steps": 1, "eval_every": 4, "eval_windows": 2}
    job = from_dict(JobConfig, {"optim": opt, "out_dir": str(tmp_path / "run"), "gc_interval": 2})
    train(job, progress=False)
    assert gc.isenabled()
    # with the collector off (the training loop) exactly two collections ran: young ones, after steps 2 and 4
    assert [gen for gen, enabled in collections if not enabled] == [1, 1]
    with pytest.raises(ConfigError, match="gc_interval"):
        from_dict(JobConfig, {"gc_interval": -1}).validate()

    def fail(*args, **kwargs):
        assert not gc.isenabled()  # inside the training loop
        raise RuntimeError("disk full (test)")

    monkeypatch.setattr("moonrt.jobs.train.loop.Checkpointer.save", fail)
    job = from_dict(JobConfig, {"optim": {**opt, "steps": 2}, "out_dir": str(tmp_path / "run2"), "gc_interval": 2})
    with pytest.raises(RuntimeError, match="disk full"):
        train(job, progress=False)
    assert gc.isenabled()
