"""What the rank processes of :func:`tests.distributed.harness.run_distributed` and the
recipe runs of :func:`tests.forked.run_python` import once, in the fork server they start
from: torch, Lightning, Hydra, Hugging Face ``transformers`` (the user-model tests' models)
and the library with the test workloads.

Built with the collector off and then frozen, as ``recipes/train.py`` does: a forked rank
neither collects nor traverses these objects, and its pages stay shared with the server.
"""

# ruff: noqa: E402, F401  (imports follow gc.disable(); they are here to be loaded once)
from __future__ import annotations

import gc

gc.disable()

import hydra
import lightning
import torch
import torch.distributed
import transformers

import moe_recipes.runner
import tests.anymodel.models
import tests.distributed.baseline_workloads
import tests.distributed.recovery_workloads
import tests.distributed.staged_workloads
import tests.distributed.workloads

gc.freeze()
gc.enable()
