"""Dense baseline configuration: a pre-norm softmax-attention + SwiGLU decoder, HF-style field names.

The baseline K3 is compared with (same vocabulary and width as K3's ``k3_tiny`` at the ``dense_tiny``
preset). Fields follow a Llama-style HF ``config.json`` (``vocab_size``, ``hidden_size``,
``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``head_dim``, ``rms_norm_eps``,
``rope_theta``, ``initializer_range``, ``tie_word_embeddings``); attention is multi-head (no GQA).
"""

from __future__ import annotations

import dataclasses
import math

from moonrt.config import check
from moonrt.parallel.model import MAX_LAYERS, PipelineLayout


@dataclasses.dataclass(kw_only=True, slots=True)
class DenseConfig:
    """A dense pre-norm decoder: per layer ``h += attn(RMSNorm(h))``, ``h += SwiGLU(RMSNorm(h))``."""

    vocab_size: int
    hidden_size: int
    """Model width ``D``."""
    intermediate_size: int
    """SwiGLU width ``F`` (gate and up ``D -> F``, down ``F -> D``)."""
    num_hidden_layers: int
    num_attention_heads: int
    """``H`` heads for queries, keys and values alike (multi-head attention)."""
    head_dim: int
    """Per-head width of q, k and v (``H * head_dim`` need not equal ``D``); even when ``rope_theta`` is set."""
    rope_theta: float | None = 10000.0
    """Rotary base (HF ``rope_theta``, rotate-half layout); None: NoPE (no positions, as K3's MLA)."""
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    """Std of the normal init of every projection and of the embedding (norm weights start at 1)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding table (refused under pipeline parallelism: they live on different ranks)."""

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                  "an integer >= 1")
        check(self.num_hidden_layers <= MAX_LAYERS, "num_hidden_layers", self.num_hidden_layers,
              f"an integer <= {MAX_LAYERS} (MAX_LAYERS)")
        for name in ("rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and value > 0, name, value, "a finite number > 0")
        if self.rope_theta is not None:
            check(isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                  and math.isfinite(self.rope_theta) and self.rope_theta > 1, "rope_theta", self.rope_theta,
                  "a finite number > 1, or null for NoPE")
            check(self.head_dim % 2 == 0, "head_dim", self.head_dim, "an even integer (rotary pairs; rope_theta set)")

    def pipeline_layout(self) -> PipelineLayout:
        """The layer stack as the pipeline sees it (:class:`moonrt.parallel.model.PipelineLayout`): ``num_layers``
        decoder layers of ``hidden_size`` width, the stream one block of ``num_hidden_layers`` layers.

        The dense residual stream is carried as one AttnRes-style block that closes only after the last layer
        (:class:`DenseStream`, ``stream.py`` of this package), so a stage cut inside the model carries block 0 (the
        embedding) once per rank and the open partial sum: exactly what
        :func:`moonrt.scheduler.attnres_comm.hop_plan` plans for a block of this size."""
        n = self.num_hidden_layers
        return PipelineLayout(num_layers=n, width=self.hidden_size, block_size=n,
                              tied_embeddings=self.tie_word_embeddings)


def dense_tiny() -> DenseConfig:
    """The CPU-trainable baseline for ``k3_tiny``: its byte vocabulary (256) and width (128), 4 layers of
    4 heads x 32, SwiGLU width 384 (3 D); untied head (pipeline parallelism needs it). About 0.92M parameters."""
    return DenseConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                       initializer_range=0.02, tie_word_embeddings=False)


PRESETS = {"dense_tiny": dense_tiny}
"""Preset name -> config factory (the registry's ``ModelSpec.presets``)."""

__all__ = ["DenseConfig", "MAX_LAYERS", "PRESETS", "dense_tiny"]
