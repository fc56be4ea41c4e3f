"""``moonrt.comm.state.shards`` saved and loaded through ``moonrt.comm.state.dcp``: several boxes of one tensor on
one rank (:class:`Boxes`), no process group.

A ZeRO-Muon owner holds whole Muon blocks, several of one parameter, possibly column blocks (not contiguous in the
flattened tensor): a column-blocked ``[*S, A, B]`` parameter's momentum written as boxes by two "ranks" (two
``dcp.save`` calls would be one collective save; here the two ranks' boxes go into one process's state: a rank with
two column blocks, another with the rest) reads back whole, bit for bit, and into another cut (row halves); each
box is its own DCP chunk, found on load by its offsets; a target no saved chunk covers is an error.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moonrt.comm.state.dcp import SafeReader, ShardLoadPlanner, ShardSavePlanner
from moonrt.comm.state.shards import Boxes, Shard, block_box
from moonrt.parallel.blocks import MatrixBlocks


def _save(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1), planner=ShardSavePlanner(),
                 no_dist=True)


def _load(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(path), planner=ShardLoadPlanner(), no_dist=True)


def test_column_blocks_of_one_tensor_as_boxes_save_and_load(tmp_path: Path) -> None:
    spec = MatrixBlocks(stack_dims=1, head_dim=2, axis=1)  # [2, 3, 8]: per stack 4 column blocks [3, 2]
    full = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    shape = tuple(full.shape)
    from moonrt.ops.muon import block_view

    mine = [1, 3, 6]  # stack 0 heads 1 and 3, stack 1 head 2: three column blocks, one rank
    boxes = Boxes(shape, [block_box(block_view(full, spec, k).clone(), full.shape, spec, k, shape) for k in mine])
    assert [p.offsets for p in boxes.parts] == [(0, 0, 2), (0, 0, 6), (1, 0, 4)]
    assert len(boxes.__create_write_items__("m", boxes)) == 3
    rest = [k for k in range(8) if k not in mine]
    other = Boxes(shape, [block_box(block_view(full, spec, k).clone(), full.shape, spec, k, shape) for k in rest])
    _save(tmp_path / "a", {"m": boxes, "m2": other})  # two entries: one per "rank" (same data split differently)

    # back into the same boxes (zeros first): each box finds its own chunk by offsets
    again = Boxes(shape, [Shard(torch.zeros_like(p.local), shape, p.offsets) for p in boxes.parts])
    _load(tmp_path / "a", {"m": again})
    for k, p in zip(mine, again.parts):
        assert torch.equal(p.local.view(3, 2), block_view(full, spec, k))

    # the other entry holds the rest: its boxes and these together are the whole tensor
    whole = torch.zeros_like(full)
    _load(tmp_path / "a", {"m2": Boxes(shape, [Shard(whole[s:s + 1, :, h * 2:h * 2 + 2], shape, (s, 0, h * 2))
                                               for s, h in (divmod(k, 4) for k in rest)])})
    for k in mine:
        block_view(whole, spec, k).copy_(block_view(full, spec, k))
    assert torch.equal(whole, full)

    # a target covering more than the saved boxes (the whole tensor from one rank's boxes) is refused
    with pytest.raises(CheckpointException, match="saved chunks hold 18 of the 48 elements"):  # DCP wraps it
        _load(tmp_path / "a", {"m": torch.zeros_like(full)})


def test_a_box_reads_across_saved_boxes(tmp_path: Path) -> None:
    """A row-half target spans pieces of all four saved column boxes of a matrix (resharding between cuts)."""
    spec = MatrixBlocks(head_dim=2, axis=1)
    full = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    from moonrt.ops.muon import block_view

    saved = Boxes((4, 8), [block_box(block_view(full, spec, k).clone(), full.shape, spec, k, (4, 8))
                           for k in range(4)])
    _save(tmp_path / "b", {"w": saved})
    top, bottom = torch.zeros(2, 8), torch.zeros(2, 8)
    _load(tmp_path / "b", {"w": Boxes((4, 8), [Shard(top, (4, 8), (0, 0)), Shard(bottom, (4, 8), (2, 0))])})
    assert torch.equal(torch.cat([top, bottom]), full)
    with pytest.raises(ValueError, match="distinct offsets"):
        Boxes((4, 8), [Shard(top, (4, 8), (0, 0)), Shard(bottom, (4, 8), (0, 0))])
