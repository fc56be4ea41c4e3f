"""Sharded checkpoint state: ``dcp`` (what each rank holds, described for torch DCP's save and load, and the
full-state gather / scatter)."""
