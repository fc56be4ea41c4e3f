"""Pipeline parallelism (K3_SYSTEMS §9): ``executor`` (runs a lowered schedule of the IR in
:mod:`moonrt.scheduler`), ``cache`` (the Block AttnRes block cache and its hops), ``part`` (the pipeline part a job
composes)."""
