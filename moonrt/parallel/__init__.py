"""The seams the model is written against, owned by the runtime: :class:`~moonrt.parallel.context.AttentionContext`
(how attention layers reach tokens outside their slice) and its single-device instance ``LOCAL``;
:class:`~moonrt.parallel.dispatch.Dispatcher` (how a MoE layer moves token-expert rows to their experts and back)
and :class:`~moonrt.parallel.dispatch.LocalDispatcher`.

The model imports these protocols; the runtime (``moonrt.comm``) implements them with collectives.
This package imports only ``moonrt.ops`` below it (``tests/test_import_direction.py``)."""
