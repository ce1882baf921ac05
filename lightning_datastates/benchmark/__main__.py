"""``python -m lightning_datastates.benchmark``: the parent process of a benchmark, or one of its workers."""

from __future__ import annotations

import sys

from lightning_datastates.benchmark.command import main

sys.exit(main())
