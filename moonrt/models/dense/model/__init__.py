"""The dense baseline model client: a pre-norm softmax-attention + SwiGLU decoder written against the same
seams and duck-typed surface as K3 (attention context, stage API, empty MoE surface), so the runtime's
parallel parts (pipeline, ZeRO-1, context parallelism) run it unchanged.

Files: ``config.py`` (:class:`DenseConfig`, presets), ``model.py`` (:class:`DenseModel`), ``attention.py``
(causal attention, rotary, the CP gather of ``[k | v]``), ``layers.py`` (RMSNorm, SwiGLU FFN), ``stream.py``
(the residual stream in the pipeline executor's ``blocks`` / ``partial`` shape), ``params.py`` (counts).
Imports only ``moonrt.ops``, ``moonrt.parallel``, ``moonrt.config`` and itself.
"""
