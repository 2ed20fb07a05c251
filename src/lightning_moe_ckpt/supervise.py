"""``python -m lightning_moe_ckpt.supervise``: run a training script under the supervisor
(:mod:`lightning_moe_ckpt.failures.cli`)."""

from __future__ import annotations

import gc
import sys

from lightning_moe_ckpt.failures.cli import main

if __name__ == "__main__":
    code = main()
    # The job is over: exit without the collector traversing the half million objects the
    # imports built (about a second of CPU).
    gc.freeze()
    sys.exit(code)
