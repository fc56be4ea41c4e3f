"""The transport seam and its backends (issue 48 item 1): a symmetric heap per group of ranks on one host
(``shm``: CPU ranks, POSIX shared memory; ``cuda``: torch symmetric memory, not proven without GPUs) and the
collectives of today behind the same :class:`~moonrt.comm.transport.base.Transport` protocol. A comm part may import
this package (as it may ``state``); it imports no part."""
