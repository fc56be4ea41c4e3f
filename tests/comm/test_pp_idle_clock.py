"""``pp_idle_frac`` on NCCL (issue 47 item 5): the pipeline's receive waits timed on the CUDA stream, where NCCL's
``work.wait()`` holds the stream and returns to the host at once (host clocks read ~0 there), checked on CPU with
stand-in events on a simulated stream timeline; the gloo path keeps the host clock."""

from __future__ import annotations

import pytest
import torch

from moonrt.comm.pp.idle import IdleClock


class Stream:
    """A simulated CUDA stream: ``t`` is when the work issued so far completes (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.syncs = 0

    def kernel(self, seconds: float) -> None:
        self.t += seconds

    def nccl_wait(self, arrives_at: float) -> None:
        """NCCL's ``work.wait()``: the stream waits for the bytes; the host returns at once."""
        self.t = max(self.t, arrives_at)


def events_on(stream: Stream):
    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self) -> None:
            self.at = stream.t

        def synchronize(self) -> None:
            stream.syncs += 1

        def elapsed_time(self, end: Event) -> float:  # milliseconds, as torch.cuda.Event's
            assert stream.syncs, "elapsed_time before the end event was synchronized"
            return (end.at - self.at) * 1e3

    return Event


def test_nccl_waits_are_the_streams_stalls():
    """1 s of compute, a receive whose bytes arrive at 1.5 s (a 0.5 s stall), 2 s of compute, a receive already
    there (no stall), 0.25 s: recv_wait_s = 0.5 and wall_s = 3.75, though every host wait returned at once."""
    s = Stream()
    clock = IdleClock(torch.device("cuda", 1), event=events_on(s))
    clock.start()
    s.kernel(1.0)
    clock.wait(lambda: s.nccl_wait(1.5))
    s.kernel(2.0)
    clock.wait(lambda: s.nccl_wait(0.2))
    s.kernel(0.25)
    wait, wall = clock.stop()
    assert s.syncs == 1  # one host synchronization per step, at its end
    assert wait == pytest.approx(0.5, abs=1e-12) and wall == pytest.approx(3.75, abs=1e-12)


def test_gloo_waits_are_host_time(monkeypatch):
    """CPU tensors (gloo): the host clock around each blocking wait, as before."""
    now = [10.0]
    monkeypatch.setattr("moonrt.comm.pp.idle.time.perf_counter", lambda: now[0])

    def blocking_wait(seconds: float):
        def run() -> None:
            now[0] += seconds
        return run

    clock = IdleClock(torch.device("cpu"))
    clock.start()
    now[0] += 1.0
    clock.wait(blocking_wait(0.5))
    now[0] += 2.0
    assert clock.stop() == (0.5, 3.5)
