"""Planners: MoonEP expert placement (``moonep``, ``moonep_torch``), the LP placement oracle (``lp``),
placement baselines (``baselines``), routing workloads (``workload``) and ``moonrt ep-sim`` (``sim``)."""
