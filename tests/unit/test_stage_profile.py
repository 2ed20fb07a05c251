"""The measured compute profile: one entry per pipeline rank, positive times, threads as
one process of the run gets, and a batch that leaves a rank no sequence is refused."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from lightning_moe_ckpt.errors import ConfigError
from moe_recipes.settings import RunSettings, settings_from_config
from moe_recipes.stage_profile import measure_compute
from tests.conftest import CONF_DIR


def settings(*overrides: str) -> RunSettings:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return settings_from_config(compose("train", overrides=["out_dir=unused", *overrides]))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_every_pipeline_rank_gets_measured_forward_and_backward(schedule: str) -> None:
    run = settings("parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4",
                   f"parallel.schedule={schedule}")
    profile = measure_compute(run, warmup=0, repeats=1, threads=1)
    assert len(profile.stages) == 2 and profile.threads == 1
    assert profile.sequences_per_microbatch == 16 // 4 // 2
    for stage in profile.stages:
        assert stage.forward_s > 0 and stage.backward_s >= 0
    assert profile.optimizer_s > 0 and profile.device_to_host_bytes_per_s > 0


def test_a_batch_without_a_whole_sequence_per_rank_is_refused() -> None:
    run = settings("parallel.ep=2", "parallel.microbatches=8", "trainer.global_batch=8")
    with pytest.raises(ConfigError, match=r"trainer\.global_batch=8 gives no whole sequence"):
        measure_compute(run, warmup=0, repeats=1)
