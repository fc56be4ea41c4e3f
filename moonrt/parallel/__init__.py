"""The seams the model is written against, owned by the runtime: :class:`~moonrt.parallel.context.AttentionContext`
(how attention layers reach tokens outside their slice) and its single-device instance ``LOCAL``;
:class:`~moonrt.parallel.dispatch.Dispatcher` (how a MoE layer moves token-expert rows to their experts and back)
and :class:`~moonrt.parallel.dispatch.LocalDispatcher`; :class:`~moonrt.parallel.packing.DocumentPacking` (the
documents packed in a batch); :mod:`moonrt.parallel.blocks` (a weight's matrix blocks, for Muon); and
:class:`~moonrt.parallel.model.TrainableModel`, what the runtime calls on a whole model (loss, pipeline stages and
:class:`~moonrt.parallel.model.PipelineLayout`, MoE routing hooks, optimizer groups).

The model imports these protocols; the runtime (``moonrt.comm``) implements them with collectives.
This package imports only ``moonrt.ops`` and ``moonrt.config`` below it (``tests/test_import_direction.py``)."""
