"""Document packing (a seam type): several documents in one ``[B, T]`` sequence batch, no information crossing them.

A packed batch carries, next to its tokens, the document index of every token (:class:`DocumentPacking`); the job
builds it (:mod:`moonrt.jobs.train.data`) and passes it to :meth:`moonrt.parallel.model.TrainableModel.loss_sum`.
The record is model-agnostic: every part of a model that mixes tokens along time must respect the boundaries, so
each document's outputs (and the gradients they send back) are those of the document run alone. It offers what
such parts need: fla's ``cu_seqlens`` for a recurrence that restarts at each document
(:func:`moonrt.ops.kda.kda_chunk`), :meth:`DocumentPacking.conv_valid` for a short causal convolution,
:meth:`DocumentPacking.attention_mask` (block-diagonal causal) for softmax attention, and ``positions`` (the
position within the document) for a model with position ids. K3 uses the first three (KDA, its short conv, MLA;
its MLA is NoPE, so there are no positions to restart); everything else of K3 is per token.

The data layer (:mod:`moonrt.jobs.train.data`) masks the target of each document's last token when the next token
starts another document (see :func:`moonrt.jobs.train.data.shard_packed`). Boundaries do not travel through
context or pipeline parallelism (:meth:`DocumentPacking.check_context`; the job refuses ``--cp``/``--pp`` with
packing).
"""

from __future__ import annotations

import dataclasses

import torch

from moonrt.parallel.context import AttentionContext


@dataclasses.dataclass(frozen=True)
class DocumentPacking:
    """Where documents start in a packed ``[B, T]`` batch; build with :meth:`from_doc_ids` or :meth:`from_lengths`.

    Documents never span rows: a row boundary is always a document boundary.
    """

    doc_ids: torch.Tensor
    """``[B, T]`` int64: document index of each token, non-decreasing along each row (any values)."""
    positions: torch.Tensor
    """``[B, T]`` int64: the token's position within its document (0 at each document start)."""
    cu_seqlens: torch.Tensor
    """``[N + 1]`` int64: fla's offsets of the N documents in the row-major flattened ``[1, B * T]`` batch."""

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor | object) -> DocumentPacking:
        """From ``doc_ids [B, T]`` integers, non-decreasing along each row (a change starts a document)."""
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point \
                or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool or doc_ids.shape[1] == 0:
            what = (f"shape {tuple(doc_ids.shape)} dtype {doc_ids.dtype}" if isinstance(doc_ids, torch.Tensor)
                    else type(doc_ids).__name__)
            raise ValueError(f"doc_ids: {what}: expected a [B, T] integer tensor with T >= 1")
        ids = doc_ids.to(torch.int64)
        B, T = ids.shape
        step = ids[:, 1:] - ids[:, :-1]
        if bool((step < 0).any()):
            row = int((step < 0).any(dim=1).nonzero()[0])
            raise ValueError(f"doc_ids row {row} = {ids[row].tolist()}: expected non-decreasing values "
                             "(documents are contiguous runs)")
        starts = torch.ones(B, T, dtype=torch.bool, device=ids.device)
        starts[:, 1:] = step != 0
        t = torch.arange(T, device=ids.device).expand(B, T)
        last_start = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
        flat = starts.reshape(-1).nonzero().squeeze(1)
        cu = torch.cat([flat, flat.new_tensor([B * T])])
        return cls(doc_ids=ids, positions=t - last_start, cu_seqlens=cu)

    @classmethod
    def from_lengths(cls, lengths: list[list[int]], device: torch.device | str | None = None) -> DocumentPacking:
        """From the document lengths of each row (every row's lengths sum to the same T >= 1)."""
        totals = {sum(row) for row in lengths}
        if not lengths or len(totals) != 1 or any(n < 1 for row in lengths for n in row) or totals == {0}:
            raise ValueError(f"lengths = {lengths}: expected rows of positive lengths with one common sum T >= 1")
        rows = [torch.repeat_interleave(torch.arange(len(row), device=device), torch.tensor(row, device=device))
                for row in lengths]
        return cls.from_doc_ids(torch.stack(rows))

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)`` of the batch this packing describes."""
        return (int(self.doc_ids.shape[0]), int(self.doc_ids.shape[1]))

    def check(self, B: int, T: int, what: str = "packing") -> None:
        """Raise ValueError unless this packing describes a ``[B, T]`` batch."""
        if self.shape != (B, T):
            raise ValueError(f"{what}: describes a batch of shape {self.shape}; expected ({B}, {T}) (the tokens')")

    def attention_mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` bool, True = attend: query ``t`` sees key ``s <= t`` of its own document."""
        T = self.doc_ids.shape[1]
        same = self.doc_ids[:, :, None] == self.doc_ids[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.doc_ids.device).tril()
        return (same & causal)[:, None]

    def check_context(self, ctx: AttentionContext) -> None:
        """Raise ValueError unless ``ctx`` is the single-device context: boundaries do not travel through the
        collectives of context parallelism (a CP slice would need its documents' offsets and KCP per document)."""
        if type(ctx) is not AttentionContext:
            raise ValueError(f"packing with attention context {type(ctx).__name__}: document boundaries do not "
                             "travel through context parallelism; expected the single-device AttentionContext")

    def conv_valid(self, lag: int) -> torch.Tensor:
        """``[B, T, 1]`` bool: whether token ``t - lag`` exists and belongs to token ``t``'s document."""
        return (self.positions >= lag)[:, :, None]


__all__ = ["DocumentPacking"]
