"""Checkpoint state: ``describe`` (what each rank holds of the single-process state, one description refined by
every part, and the generic full-state gather / scatter over it) and ``dcp`` (the sharded-state values ``Shard`` /
``Boxes`` that describe it for torch DCP's save and load)."""
