"""Recipe config composition and validation: bad input fails before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import DictConfig

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.training.data import build_corpus
from moe_recipes.settings import settings_from_config
from tests.conftest import CONF_DIR


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("train", overrides=list(overrides))


def test_default_config_is_tiny_on_cpu() -> None:
    settings = settings_from_config(_compose())
    assert settings.model.name == "tiny" and settings.model.n_layers == 4
    assert settings.model.n_experts == 8 and settings.model.top_k == 2
    assert settings.precision == "32" and settings.api == "trainer"
    assert settings.data.name == "stdlib" and settings.layout.world_size == 1


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt_moe", "qwen_moe", "deepseek_moe",
                                    "moe_llava"])
def test_every_preset_composes(preset: str) -> None:
    settings = settings_from_config(_compose(f"model={preset}", "data.seq_len=16"))
    assert settings.model.name == preset


def test_unknown_preset_names_group_and_value() -> None:
    with pytest.raises(MissingConfigException, match="model/no_such_model"):
        _compose("model=no_such_model")


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.top_k=9"], r"model\.top_k=9 must be <= model\.n_experts=8"),
    (["model.capacity_factor=0"], r"model\.capacity_factor=0 must be > 0"),
    (["trainer.precision=fp8"], r"trainer\.precision='fp8'"),
    (["api=jax"], r"api='jax'"),
    (["data.seq_len=65"], r"data\.seq_len=65 must be in \[1, model\.max_seq_len=64\]"),
    (["parallel.ep=3"], r"model\.n_experts=8 is not divisible by parallel\.ep=3"),
    (["parallel.pp=8", "parallel.microbatches=8"],
     r"model\.n_layers=4 is fewer than the 8 pipeline stages of parallel\.pp=8"),
    (["parallel.pp=2", "parallel.microbatches=1"],
     r"parallel\.microbatches=1 is fewer than parallel\.pp=2"),
    (["parallel.schedule=gpipe"], r"parallel\.schedule='gpipe' is unknown"),
    (["parallel.pp=4", "parallel.microbatches=4", "parallel.schedule=interleaved_1f1b"],
     r"model\.n_layers=4 is fewer than the 8 pipeline stages"),
    (["+parallel.tp=2"], r"parallel\.tp"),
    (["+hardware.gpus=2"], r"hardware\.gpus"),
    (["parallel.microbatches=0"], r"parallel\.microbatches=0"),
    (["+trainer.max_stepz=3"], r"trainer\.max_stepz"),
    (["trainer.optim.lr=-1"], r"trainer\.optim\.lr=-1"),
    (["trainer.max_steps=3.7"], r"trainer\.max_steps=3\.7 must be an integer >= 1"),
    (["trainer.seed=abc"], r"trainer\.seed='abc' must be an integer >= 0"),
    (["trainer.global_batch=true"], r"trainer\.global_batch=True must be an integer"),
    (["trainer.val_batches=0"], r"trainer\.val_batches=0 must be an integer >= 1"),
    (["trainer.progress_bar=no"], r"trainer\.progress_bar='no' must be true or false"),
    (["trainer.optim.lr=abc"], r"trainer\.optim\.lr='abc' must be a number > 0"),
    (["trainer.optim.min_lr_ratio=-1"], r"trainer\.optim\.min_lr_ratio=-1 must be .* \[0, 1\]"),
    (["trainer.optim.warmup_steps=2.5"], r"trainer\.optim\.warmup_steps=2\.5"),
    (["trainer.optim.weight_decay=-1"], r"trainer\.optim\.weight_decay=-1"),
    (["trainer.optim.eps=0"], r"trainer\.optim\.eps=0 must be a number > 0"),
    (["trainer.optim.betas=[0.9]"], r"trainer\.optim\.betas=\(0\.9,\) must be two numbers"),
    (["trainer.optim.betas=[1.5,0.9]"], r"trainer\.optim\.betas=\(1\.5, 0\.9\)"),
    (["checkpoint.popularity=bogus"], r"checkpoint\.popularity='bogus' is not one of"),
    (["checkpoint.ema_alpha=abc"], r"checkpoint\.ema_alpha='abc' must be a number"),
    (["checkpoint.reorder_change_threshold=x"], r"checkpoint\.reorder_change_threshold='x'"),
    (["+checkpoint.top_k=100"], r"unknown key\(s\) checkpoint\.top_k"),
    (["+checkpoint.n_experts=3"], r"unknown key\(s\) checkpoint\.n_experts"),
    (["checkpoint=gemini", "checkpoint.interval=0"], r"checkpoint\.interval=0"),
    (["checkpoint=moc", "checkpoint.experts_per_layer=99"],
     r"checkpoint\.experts_per_layer=99"),
    (["checkpoint=none", "checkpoint.durable_every=1"],
     r"checkpoint\.durable_every=1 has no effect with checkpoint=none"),
    (["checkpoint=lightning", "checkpoint.replicas=3"],
     r"checkpoint\.replicas=3 has no effect with checkpoint=lightning"),
    (["checkpoint.same_node_replicas=mapped"],
     r"checkpoint\.same_node_replicas='mapped' must be one of shared, copied"),
    (["checkpoint=none", "+checkpoint.same_node_replicas=copied"],
     r"checkpoint\.same_node_replicas='copied' has no effect with checkpoint=none"),
    (["checkpoint.checksum_threads=0"],
     r"checkpoint\.checksum_threads=0 must be an integer >= 1 \(or null"),
    (["checkpoint=gemini", "checkpoint.checksum_threads=two"],
     r"checkpoint\.checksum_threads='two' must be an integer >= 1"),
    (["checkpoint=none", "+checkpoint.checksum_threads=2"],
     r"checkpoint\.checksum_threads=2 has no effect with checkpoint=none"),
    (["checkpoint.helper_nice=20"],
     r"checkpoint\.helper_nice=20 must be an integer from 0 .* to 19"),
    (["checkpoint=lightning", "+checkpoint.helper_nice=5"],
     r"checkpoint\.helper_nice=5 has no effect with checkpoint=lightning"),
    (["+data.path=/tmp/corpus.txt"], r"data\.path='/tmp/corpus\.txt' is a setting of "
                                     r"data=textfile; data=stdlib does not use it"),
    (["data=textfile", "+data.val_percent=3"], r"data\.val_percent=3 is a setting of"),
    (["data.name=foo"], r"data\.name='foo' is unknown"),
    (["model.vocab_size=10"], r"model\.vocab_size=10 is smaller than data=stdlib's "
                              r"vocabulary of 256"),
    (["api=fabric", "checkpoint=lightning", "checkpoint.max_overhead=7"],
     r"checkpoint\.max_overhead=7 must be a number in \(0, 1\)"),
    (["api=fabric", "checkpoint=dcp", "checkpoint.interval=oracle", "checkpoint.mtbf_steps=-1"],
     r"checkpoint\.mtbf_steps=-1 must be a number > 0"),
    (["api=fabric", "checkpoint=dcp", "checkpoint.interval=0"], r"checkpoint\.interval=0"),
    (["model.norm_eps=-1"], r"model\.norm_eps=-1 must be a number > 0"),
    (["model.aux_loss_coef=abc"], r"model\.aux_loss_coef='abc' must be a number >= 0"),
    (["model.n_layers=true"], r"model\.n_layers=True must be a positive integer"),
    (["model=hf_qwen3_moe", "api=trainer", "model.n_shared_experts=2"],
     r"model\.n_shared_experts=2 is not supported with model\.family='hf_qwen3_moe'"),
    (["model=hf_qwen3_moe", "api=trainer", "model.capacity_factor=1.25"],
     r"model\.capacity_factor=1\.25 is not supported .* set it to null"),
    (["model=hf_qwen3_moe", "api=trainer", "model.aux_loss_coef=0.01"],
     r"model\.aux_loss_coef=0\.01 is not supported .* set it to 0"),
    (["recovery.fork_workers=yes"], r"recovery\.fork_workers='yes' must be true or false"),
    (["hardware.accelerator=tpu"], r"hardware\.accelerator='tpu' must be one of cpu, cuda"),
    (["hardware.backend=foo"], r"hardware\.backend='foo' must be one of gloo, nccl"),
    (["hardware.nodes=0"], r"hardware\.nodes=0 must be an integer >= 1"),
    (["hardware.nodes=3", "parallel.pp=2", "parallel.microbatches=2"],
     r"hardware\.nodes=3 does not divide the world size 2"),
])
def test_bad_values_name_key_and_value(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        settings_from_config(_compose(*overrides))


def test_textfile_without_path_names_data_path() -> None:
    settings = settings_from_config(_compose("data=textfile"))
    with pytest.raises(ConfigError, match=r"set data\.path \(got data\.path=None\)"):
        build_corpus(settings.data)


def test_textfile_with_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    settings = settings_from_config(_compose("data=textfile", f"data.path={missing}"))
    with pytest.raises(ConfigError, match="is not an existing file"):
        build_corpus(settings.data)
