"""moonrt: a distributed training runtime for Kimi K3 infrastructure on torch.distributed."""

__version__ = "0.1.0"
