"""The paired-block measurement: snapshots in alternate blocks of whole windows, and the
per-cycle ratios the benchmark takes from one such run."""

from __future__ import annotations

from itertools import groupby

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config
from moe_recipes.statistics import PairedBlocks, paired_block_ratios


def test_each_cycle_gives_the_ratio_of_its_settled_steps() -> None:
    taken = [0, 0, 0] + [1] * 5 + [0] * 5 + [1] * 5 + [0] * 5 + [1] * 5
    # Steps of a switch and the first two of each block are outliers: none may count.
    times = [1000.0] * len(taken)
    on, off = [3.0, 5.0], [2.0, 2.0]  # the settled steps of each block, in order
    for start, settled in ((3, on), (8, off), (13, [6.0, 6.0]), (18, [4.0, 2.0])):
        times[start + 3:start + 5] = settled
    # Two whole cycles; the last block, with snapshots, has no block without after it.
    assert paired_block_ratios(times, taken) == [4.0 / 2.0, 6.0 / 3.0]
    assert paired_block_ratios(times, taken, settle=4) == []  # no settled step left
    with pytest.raises(ValueError, match="28 iteration times for 27 steps"):
        paired_block_ratios(times, taken[:-1])


def test_blocks_switch_only_where_a_window_starts_and_every_window_taken_is_whole() -> None:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"global_batch": 4, "max_steps": 42}}))
    engine = TrainingEngine.local(settings)
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=3)
    checkpointing.window_filter = PairedBlocks(4)
    coordinator = checkpointing.attach(engine)
    generator = torch.Generator().manual_seed(0)
    for _ in range(42):  # 14 whole windows
        tokens = torch.randint(0, 256, (1, 4, 17), generator=generator)
        engine.train_iteration(tokens[..., :-1], tokens[..., 1:])
    checkpointing.close()
    metrics = coordinator.metrics(1.0)
    taken = metrics["snapshot_taken_per_step"]
    assert len(taken) == 42
    runs = [(flag, len(list(steps))) for flag, steps in groupby(taken)]
    assert {flag for flag, _ in runs} == {0, 1} and len(runs) >= 6  # it alternated
    step = 0
    for flag, length in runs:
        assert length % 3 == 0, runs  # whole windows of W = 3, taken or not
        for window_start in range(step, step + length, 3):
            assert (window_start // 4) % 2 == (0 if flag else 1), (window_start, runs)
        step += length
    # Every window taken (and the initial dense snapshot) captured every operator exactly
    # once, every piece checksummed.
    assert metrics["windows_covered"] == sum(taken) // 3 + 1
    assert metrics["windows_not_covered"] == 0
    assert metrics["pieces_checksummed"] == metrics["pieces_issued"] > 0


@pytest.mark.parametrize(("overrides", "message"), [
    (["checkpoint.paired_blocks=0"], r"checkpoint\.paired_blocks=0 must be an integer >= 1"),
    (["checkpoint=none", "+checkpoint.paired_blocks=8"],
     r"checkpoint\.paired_blocks=8 has no effect with checkpoint=none"),
    (["checkpoint.paired_blocks=8", "faults=mtbf"],
     r"checkpoint\.paired_blocks=8 measures the snapshots' cost .* faults=mtbf"),
])
def test_bad_paired_blocks_are_refused_naming_the_key(overrides: list[str],
                                                      message: str) -> None:
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        settings_from_config(cfg)
