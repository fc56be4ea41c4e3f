"""ZeRO-1 (optimizer state sharded over data-parallel ranks): ``core`` (the shard plan and the gather / scatter both
optimizers share), ``adamw`` (AdamW), ``muon`` (Per-Head Muon, whole matrix blocks per owner)."""
