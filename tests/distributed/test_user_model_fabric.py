"""A user's own Fabric loop over a HF MoE split by ``FabricMoEParallelStrategy``.

The loop (``tests/distributed/fabric_user_parallel.py``) is the user's: parallelize the
model, a plain AdamW, ``fabric.setup``, a step of ``strategy.forward_backward``, clipping
and ``optimizer.step()``, protected by ``SparseCheckpointing.protect``. Under pp=2 x ep=2 a
simulated failure of the last stage mid-window is recovered bitwise against the fault-free
run of the same layout; only that stage's ranks roll back and the paused ones run no
forward/backward pass. Under pp=2 the loop ends bitwise equal to the same loop in one
process (expert-parallel layouts against one process: ``test_user_model_trainer.py`` and
``test_user_model_parallel.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.script_runs import (
    assert_equal_runs,
    assert_recovered,
    assert_same_model,
    run_script,
)

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

SCRIPT = "tests.distributed.fabric_user_parallel"


def test_fabric_loop_of_a_users_model_recovers_a_failure_bitwise(tmp_path: Path) -> None:
    golden = run_script(SCRIPT, tmp_path / "golden.pt", "2", "2", ranks=4)
    recovered = run_script(SCRIPT, tmp_path / "failed.pt", "2", "2", "5:2", ranks=4)
    assert_equal_runs(golden, recovered)
    assert_recovered(recovered, failed=2, scope=[2, 3])


def test_fabric_pipeline_of_a_users_model_equals_one_process_bitwise(tmp_path: Path) -> None:
    one_process = run_script(SCRIPT, tmp_path / "one.pt", "1", "1", ranks=1)
    assert_same_model(one_process, run_script(SCRIPT, tmp_path / "pp2.pt", "2", "1", ranks=2))
