"""The K3 decoder (K3_SYSTEMS §1-5): embedding, KDA/MLA + FFN/LatentMoE layers, Block AttnRes, LM head.

Layer ``l`` (0-indexed) is a :class:`DecoderLayer` with two sub-layers, each fed by Block AttnRes
(:mod:`moonrt.models.k3.model.attnres`) instead of a plain residual sum:

    h = AttnRes_{2l}(blocks, partial);     partial += attn(attn_norm(h))     KDA or gated MLA
    h = AttnRes_{2l+1}(blocks, partial);   partial += ffn(ffn_norm(h))       dense GLU FFN or LatentMoE

then ``final = AttnRes_final(all blocks)``, ``logits = lm_head(norm(final))`` in fp32
(``promote(dtype, float32)``: an fp64 model computes in fp64 throughout).

Module names are stable (memory policies and checkpoints match them): ``embed``, ``layers.{l}.attn``
(a ``KDALayer`` or :class:`GatedMLA`), ``layers.{l}.attn_norm``, ``layers.{l}.ffn`` (dense, layers
``< first_k_dense_replace``) or ``layers.{l}.moe`` (LatentMoE), ``layers.{l}.ffn_norm``, ``attn_res``,
``norm``, ``lm_head``.

Seams (the model holds no process groups): :class:`K3Model` is a :class:`moonrt.parallel.model.TrainableModel`
(loss, stage API, MoE routing hooks, optimizer groups); ``ctx`` (an :class:`AttentionContext`, context
parallelism), each LatentMoE's ``dispatcher`` (expert parallelism), and the stage API
:meth:`K3Model.embed_tokens` / :meth:`K3Model.run_layers` / :meth:`K3Model.head` with :meth:`K3Model.stages`
for pipeline parallelism (stages cut between decoder layers; the :class:`AttnResState` -- the protocol's
``Stream``: AttnRes block representations and the open partial block -- crosses them).

Packed documents: ``packing`` (:class:`moonrt.parallel.packing.DocumentPacking`) goes to every attention
sub-layer (KDA: per-document state and short conv; MLA: block-diagonal causal mask); all other parts are
per token, so each document's logits are those of the document run alone.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from moonrt.models.k3.model.attnres import AttnResState, BlockAttnRes
from moonrt.models.k3.model.balance import AllReduce
from moonrt.models.k3.model.config import K3Config, MoEConfig
from moonrt.models.k3.model.ffn import dense_ffn
from moonrt.models.k3.model.kda_layer import KDALayer
from moonrt.models.k3.model.mla import GatedMLA
from moonrt.models.k3.model.moe import LatentMoE, RoutingStats
from moonrt.models.k3.model.norm import RMSNorm
from moonrt.ops.precision import at_least_fp32, token_loss_sum
from moonrt.ops.qat import QATScheme
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.decoder import check_tokens, lm_head, token_embedding
from moonrt.parallel.model import ParamGroups, PipelineLayout
from moonrt.parallel.packing import DocumentPacking


class DecoderLayer(nn.Module):
    """One decoder layer: ``attn_norm``, ``attn`` (KDA or MLA), ``ffn_norm``, ``ffn`` or ``moe``."""

    def __init__(self, config: K3Config, index: int, moe_config: MoEConfig | None = None) -> None:
        super().__init__()
        self.index = index
        self.kind = config.layer_types()[index]
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = KDALayer(config) if self.kind == "kda" else GatedMLA(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(index):
            self.moe = LatentMoE(config, moe_config)
        else:
            self.ffn = dense_ffn(config)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def attention(self, h: torch.Tensor, ctx: AttentionContext,
                  packing: DocumentPacking | None = None) -> torch.Tensor:
        """Attention sub-layer output ``[B, T, D]`` from its AttnRes input ``h [B, T, D]`` (``packing``: the
        documents packed in the rows, none mixed with another)."""
        return self.attn(self.attn_norm(h), ctx=ctx, packing=packing)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """FFN / MoE sub-layer output ``[B, T, D]`` from its AttnRes input ``h [B, T, D]``."""
        x = self.ffn_norm(h)
        return self.moe(x) if self.is_moe else self.ffn(x)


class K3Model(nn.Module):
    """The K3 decoder-only language model.

    Args:
        config: the model (:func:`moonrt.models.k3.model.config.k3_tiny` for training; never instantiate ``k3``).
        moe_config: :class:`moonrt.models.k3.model.config.MoEConfig` (Quantile Balancing estimator etc.) for every
            LatentMoE layer; None uses its defaults.
    """

    def __init__(self, config: K3Config, moe_config: MoEConfig | None = None) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed = token_embedding(config.vocab_size, d, config.initializer_range)
        self.layers = nn.ModuleList(DecoderLayer(config, i, moe_config) for i in range(config.num_hidden_layers))
        self.attn_res = BlockAttnRes(d, config.num_hidden_layers, config.attn_res_block_size, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = lm_head(self.embed, config.tie_word_embeddings, config.initializer_range)

    # ---- pipeline-stage API ----------------------------------------------------------------------
    def pipeline_layout(self) -> PipelineLayout:
        """Depth, width and AttnRes block size (:meth:`K3Config.pipeline_layout`)."""
        return self.config.pipeline_layout()

    def stages(self, num_stages: int, align_to_blocks: bool = False) -> list[range]:
        """Split the decoder layers into ``num_stages`` contiguous, near-equal layer ranges.

        With ``align_to_blocks`` the cuts fall on AttnRes block boundaries (then only finished block
        representations cross a stage boundary; needs ``num_stages <= number of blocks``).
        """
        n = self.config.num_hidden_layers
        if align_to_blocks:
            blocks = self.attn_res.block_ranges()
            if not 1 <= num_stages <= len(blocks):
                raise ValueError(f"num_stages = {num_stages}: expected 1..{len(blocks)} (AttnRes blocks)")
            cuts = [blocks[i * len(blocks) // num_stages].start for i in range(num_stages)] + [n]
        else:
            if not 1 <= num_stages <= n:
                raise ValueError(f"num_stages = {num_stages}: expected 1..{n} (decoder layers)")
            cuts = [i * n // num_stages for i in range(num_stages + 1)]
        return [range(cuts[i], cuts[i + 1]) for i in range(num_stages)]

    def stage_modules(self, layers: range, first: bool, last: bool) -> list[str]:
        """Names of the modules a pipeline stage running decoder ``layers`` uses (``first``: it embeds the
        tokens; ``last``: it runs the head). The AttnRes pseudo-queries are used by every stage."""
        names = ["attn_res"] + [f"layers.{i}" for i in layers]
        return names + (["embed"] if first else []) + (["norm", "lm_head"] if last else [])

    @staticmethod
    def stream(blocks: list[torch.Tensor], partial: torch.Tensor | None = None) -> AttnResState:
        """The stream a pipeline stage starts from: finished ``blocks`` and the open ``partial`` block ``[B, T, D]``."""
        return AttnResState(blocks=list(blocks), partial=partial)

    def embed_tokens(self, tokens: torch.Tensor) -> AttnResState:
        """``tokens [B, T]`` int64 -> the initial stream (block 0 = token embedding ``[B, T, D]``)."""
        check_tokens(tokens, self.config.vocab_size)
        return AttnResState(blocks=[self.embed(tokens)])

    def run_layers(self, state: AttnResState, layers: range, ctx: AttentionContext = LOCAL,
                   two_phase: bool = False, packing: DocumentPacking | None = None) -> AttnResState:
        """Run decoder ``layers`` on the stream ``state`` (mutated and returned); ``packing``: packed documents."""
        decoder = self.decoder_layers()
        for i in layers:
            layer = decoder[i]
            if layer is None:
                raise ValueError(f"layers: decoder layer {i} is not held by this pipeline rank")
            self.attn_res.begin_layer(i, state, two_phase)
            state.add(layer.attention(self.attn_res.sublayer_input(i, 0, state, two_phase), ctx, packing))
            state.add(layer.feed_forward(self.attn_res.sublayer_input(i, 1, state, two_phase)))
            self.attn_res.end_layer(i, state)
        return state

    def head(self, state: AttnResState) -> torch.Tensor:
        """Final AttnRes aggregation, norm and LM head: ``logits [B, T, vocab]`` fp32 (fp64 for an fp64 model)."""
        return at_least_fp32(self.lm_head(self.norm(self.attn_res.final(state))))

    # ---- whole model -----------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, ctx: AttentionContext = LOCAL, two_phase: bool = False,
                packing: DocumentPacking | None = None) -> torch.Tensor:
        """``tokens [B, T]`` int64 (this rank's sequence slice under CP) -> ``logits [B, T, vocab]`` fp32 (fp64 for an
        fp64 model).

        ``two_phase`` computes AttnRes in its two-phase inference form (same result to fp32 rounding).
        ``packing``: the documents packed in the rows (single-device context); no token sees another document.
        """
        state = self.embed_tokens(tokens)
        if packing is not None:
            B, T = tokens.shape
            packing.check(B, T, "packing")
            packing.check_context(ctx)
        state = self.run_layers(state, range(self.config.num_hidden_layers), ctx, two_phase, packing)
        return self.head(state)

    def loss_sum(self, tokens: torch.Tensor, targets: torch.Tensor, ctx: AttentionContext = LOCAL,
                 packing: DocumentPacking | None = None) -> torch.Tensor:
        """Summed next-token cross-entropy (fp32 scalar) over all ``targets [B, T]`` except those equal to
        -100 (torch's ``ignore_index``; a packed batch's cross-document targets, see :mod:`moonrt.parallel.packing`).

        Sum, not mean: a runtime divides by the *global* token count so the loss is the mean over
        every token of the global batch whatever the data/context split.
        """
        logits = self(tokens, ctx=ctx, packing=packing)
        return token_loss_sum(logits, targets)  # fp32 even under a bf16 autocast region (the loss island)

    # ---- MoE routing -----------------------------------------------------------------------------
    def decoder_layers(self) -> list[DecoderLayer | None]:
        """``layers`` with their type (``nn.ModuleList`` erases it); None for a layer a pipeline rank dropped."""
        return cast("list[DecoderLayer | None]", list(self.layers))

    def moe_layers(self) -> list[tuple[int, LatentMoE]]:
        """``(layer index, LatentMoE)`` for every MoE layer this process holds (a pipeline rank drops the others)."""
        return [(i, layer.moe) for i, layer in enumerate(self.decoder_layers()) if layer is not None and layer.is_moe]

    def update_routing_bias(self, all_reduce: AllReduce | None = None) -> dict[int, RoutingStats]:
        """Quantile Balancing bias update (K3_SYSTEMS §5.3) on every MoE layer from the statistics of the
        training forwards since the last update. ``all_reduce`` (given by the runtime) sums statistics in
        place across ranks; None = single process. Returns ``{layer: RoutingStats}``."""
        return {i: moe.update_bias(all_reduce=all_reduce) for i, moe in self.moe_layers()}

    def routing_counts(self) -> dict[int, torch.Tensor]:
        """Per MoE layer, tokens routed to each expert ``[E]`` int64 in the last forward (k per token)."""
        return {i: moe.last_counts.clone() for i, moe in self.moe_layers()}

    def set_record_routing(self, enabled: bool) -> None:
        """Whether MoE forwards count toward routing statistics (off for eval and recomputation)."""
        for _, moe in self.moe_layers():
            moe.record_routing = enabled

    # ---- quantization-aware training ------------------------------------------------------------------
    def enable_qat(self, scheme: QATScheme | None) -> list[str]:
        """Quantization-aware training (K3_SYSTEMS §1; :mod:`moonrt.ops.qat`): from the next forward, the routed
        and shared experts of every MoE layer held here compute with ``scheme``'s fake-quantized weights (MXFP4)
        and inputs (MXFP8), straight-through gradients to the fp32 parameters; None switches it off. Which layers
        and why: :func:`moonrt.models.k3.spec.qat_weights`. Returns the names of the quantized parameters (a
        pipeline rank: those of its stages). ValueError if ``block`` does not divide a quantized reduction axis."""
        if scheme is not None:
            c = self.config
            scheme.check_axis(c.routed_expert_hidden_size, "the routed experts' gate / up (routed_expert_hidden_size)")
            scheme.check_axis(c.moe_intermediate_size, "the experts' down projections (moe_intermediate_size)")
            scheme.check_axis(c.hidden_size, "the shared experts' gate / up (hidden_size)")
        names = []
        for i, moe in self.moe_layers():
            moe.experts.qat = scheme
            names += [f"layers.{i}.moe.experts.{w}" for w in ("w_gate", "w_up", "w_down")]
            for j, expert in enumerate(moe.shared_experts):
                expert.qat = scheme
                names += [f"layers.{i}.moe.shared_experts.{j}.{w}_proj.weight" for w in ("gate", "up", "down")]
        return names

    # ---- optimizer groups ------------------------------------------------------------------------
    def param_groups(self) -> ParamGroups:
        """The token embedding takes no weight decay (a lookup table); the LM head does, like every matrix."""
        return ParamGroups(no_weight_decay=("embed",))
