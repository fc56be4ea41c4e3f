"""``python -m moonrt.jobs.selftest`` (what ``moonrt launch --selftest`` and torchrun run on every rank)."""

import sys

from moonrt.jobs.selftest.cli import main

sys.exit(main())
