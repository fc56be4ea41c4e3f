"""Expert parallelism (K3_SYSTEMS §6): ``parallel`` (``ExpertParallel``, the part a job composes), ``dispatch``
(MoonEP's dispatch / combine / prefetch with its exact-balance plan), ``alltoall`` (the home-rank baseline),
``layout`` (the rows' send / receive layout), ``collectives`` (the all-to-all calls), ``slots`` (the slot pool of
prefetched expert weights), ``ref`` (the single-process reference)."""
