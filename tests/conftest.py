"""Shared fixtures. Multi-rank tests use :func:`dist_run` from ``tests/dist.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
