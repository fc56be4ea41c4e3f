"""The dense residual stream in the shape the pipeline executor moves (``blocks`` + ``partial``).

A pre-norm decoder feeds every sub-layer the residual ``h = e + sum of earlier sub-layer outputs``
(``e`` the token embedding). The runtime's pipeline executor (``moonrt.comm.pp.executor``, with the block
plan of ``moonrt.comm.pp.cache`` / ``moonrt.scheduler.attnres_comm``) moves a Block-AttnRes stream:
finished blocks (block 0 = the embedding) plus the open partial block. The dense stream is that stream
with one block spanning every layer and a plain sum in place of the AttnRes softmax:

- ``blocks[0]`` = ``e`` ``[B, T, D]``; ``partial`` = running sum of the sub-layer outputs (None before the
  first one); the residual is ``blocks[0] + partial`` (:meth:`DenseStream.residual`);
- after the last layer the model closes the block (``blocks = [e, partial]``, ``partial = None``), as
  ``hop_plan`` expects of a block of ``num_hidden_layers`` layers (block 1 produced by the last stage).

Every residual is ``e + partial`` with ``partial`` accumulated left to right, sub-layer by sub-layer,
whichever stage computes it, so a pipelined forward performs the same floating-point operations in the
same order as the single-process one (bitwise equal on one device type).
"""

from __future__ import annotations

import dataclasses

import torch

from moonrt.parallel.decoder import BlockStream


@dataclasses.dataclass
class DenseStream(BlockStream):
    """The residual stream between decoder layers and across pipeline stages (:class:`BlockStream`: ``add``,
    ``close_block`` and ``sources`` are its).

    ``blocks``: ``[e]`` (the embedding ``[B, T, D]``) while the block is open; ``[e, s]`` after the last
    layer closed it (``s`` the sum of every sub-layer output). ``partial``: the running sum ``[B, T, D]``
    of the sub-layer outputs so far, None before the first sub-layer and after the close.
    """

    def residual(self) -> torch.Tensor:
        """The residual ``[B, T, D]``: the sum of :meth:`sources` left to right (``e`` or ``e + partial``).

        ValueError when the stream holds more than one finished block besides the embedding (not a dense
        stream: at most ``[e, s]`` or ``[e] + partial``)."""
        src = self.sources()
        if not 1 <= len(src) <= 2:
            raise ValueError(f"dense stream with {len(self.blocks)} blocks and partial "
                             f"{'set' if self.partial is not None else 'None'}: expected [embedding] plus at most "
                             "one running sum")
        return src[0] if len(src) == 1 else src[0] + src[1]


__all__ = ["DenseStream"]
