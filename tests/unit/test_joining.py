"""A replacement joining a running job under the Trainer, piece by piece: its train loader
starts where the job resumes and reads the replay's batches again, what it cannot
reproduce is refused at set-up naming the setting, and its recovery timeout must be the
supervisor's."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.target import PipelineExecution, UserModelParallelism
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.join import JoiningLoader, check_replaceable
from lightning_moe_ckpt.failures.protocol import ENV_STORE, TIMEOUT_KEY
from lightning_moe_ckpt.failures.rendezvous import JobStore
from tests.conftest import job_channel


def _loader(shuffle: bool = False) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=3)
    return DataLoader(data, batch_size=2, sampler=sampler)  # 6 batches an epoch


def _values(batches: Any) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


def test_the_first_pass_starts_where_the_job_resumes_and_later_passes_are_whole() -> None:
    loader = JoiningLoader(_loader(), lambda: 6)
    assert len(loader) == 6 and loader.sampler is loader.loader.sampler
    first = iter(loader)  # created before the recovery (Lightning does): nothing read yet
    loader.start = 8  # epoch 1, batch 2
    assert _values(first) == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert _values(loader) == _values(_loader())  # the next epoch, whole


def test_reading_before_the_recovery_set_the_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="read before this replacement recovered"):
        next(iter(JoiningLoader(_loader(), lambda: 6)))


def test_replay_batches_are_read_again_per_epoch_with_the_samplers_epoch() -> None:
    reference = _loader(shuffle=True)
    epochs = []
    for epoch in range(2):
        reference.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        epochs.append(_values(reference))
    loader = JoiningLoader(_loader(shuffle=True), lambda: 6)
    for step in (3, 4, 5, 6, 7, 2):  # forward within an epoch, then a new one, then back
        record = loader.batch_record(step)
        epoch, index = divmod(step, 6)
        assert (record.step, record.batch_idx, record.state) == (step, index, None)
        assert record.batch[0].tolist() == epochs[epoch][index]


class _Splitting(UserModelParallelism):
    """A strategy that split a user's model and replaces failed ranks."""

    def __init__(self, replaces: bool = True) -> None:
        self.replaces = replaces

    @property
    def replaces_failed_ranks(self) -> bool:
        return self.replaces

    def user_layout(self) -> ParallelPlan | None:
        return ParallelPlan(2, 1, 1, 2, 2, 4)

    def user_grad_norm(self) -> torch.Tensor:
        return torch.zeros(())

    @property
    def data_shard(self) -> int:
        return 0

    @property
    def user_pipeline(self) -> PipelineExecution | None:
        return None


def _trainer(strategy: object = None, schedulers: tuple[Any, ...] = (),
             batches: int | float = 6, automatic: bool = True) -> Any:
    return SimpleNamespace(strategy=strategy if strategy is not None else _Splitting(),
                           lightning_module=SimpleNamespace(automatic_optimization=automatic),
                           lr_scheduler_configs=list(schedulers), num_training_batches=batches)


def _scheduler(interval: str = "step", plateau: bool = False) -> Any:
    return SimpleNamespace(scheduler=object(), interval=interval, reduce_on_plateau=plateau)


def _check(trainer: Any) -> None:
    check_replaceable(trainer, trainer.strategy)


def test_what_a_replacement_could_not_reproduce_is_refused_naming_it() -> None:
    _check(_trainer(schedulers=(_scheduler(),)))  # per-step schedules: fine
    with pytest.raises(ConfigError, match="interval='epoch'"):
        _check(_trainer(schedulers=(_scheduler("epoch"),)))
    with pytest.raises(ConfigError, match="ReduceLROnPlateau"):
        _check(_trainer(schedulers=(_scheduler(plateau=True),)))
    with pytest.raises(ConfigError, match="train DataLoader has no length"):
        _check(_trainer(batches=float("inf")))
    with pytest.raises(ConfigError, match="strategy=_Splitting"):
        _check(_trainer(_Splitting(replaces=False)))
    with pytest.raises(ConfigError, match=r"ModelParallelStrategy runs it sharded by FSDP2.*"
                                          r"strategy=DDPStrategy"):
        check_replaceable(_trainer(DDPStrategy()), None)  # no way to replace a rank
    _check(_trainer(automatic=False))  # manual optimization, no scheduler: fine
    with pytest.raises(ConfigError, match=r"automatic_optimization=False with lr_scheduler "
                                          r"object: .* one step behind"):
        _check(_trainer(schedulers=(_scheduler(),), automatic=False))


def test_a_recovery_timeout_other_than_the_supervisors_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
    job_channel(store).set(TIMEOUT_KEY, "30.0")
    monkeypatch.setenv(ENV_STORE, f"127.0.0.1:{store.port}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"recovery_timeout_s=60\.0 .*\(--timeout-s\)"):
        JobStore.from_env(60.0)
    job = JobStore.from_env(30.0)
    assert job is not None and job.collective_timeout == timedelta(seconds=10)
    assert os.environ[ENV_STORE] == job.address


@pytest.mark.parametrize("seconds", [20.0, 100.0, 200.0, 7.0])
def test_a_recovery_timeout_whose_third_is_not_whole_microseconds_is_accepted(
        monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """20 s is the supervisor's 20 s, though a third of it rounds in a timedelta."""
    from lightning_moe_ckpt.failures import rendezvous

    monkeypatch.setattr(rendezvous, "_THIS_PROCESS", {})
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
    job_channel(store).set(TIMEOUT_KEY, repr(seconds))
    monkeypatch.setenv(ENV_STORE, f"127.0.0.1:{store.port}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    job = JobStore.from_env(seconds)
    assert job is not None and job.hang_timeout_s == seconds


FENCED_WORKER = """
import os, sys
from lightning_moe_ckpt.failures.rendezvous import JobStore
job = JobStore.from_env(30.0)
print(os.getpid(), flush=True)
sys.stdin.readline()  # the test fences this process (or not) meanwhile
job.arrive(1)  # generation 1's rendezvous
"""


@pytest.mark.parametrize("host", ["here", "elsewhere"])
def test_a_fenced_process_takes_no_part_in_a_newer_generation(host: str) -> None:
    """The supervisor gave up on this process (rank 0) and replaced it: when it comes
    back it stops (exit 84) before it counts in at generation 1. A fence for the same
    rank and pid on another machine is not its own."""
    import socket
    import subprocess
    import sys

    from lightning_moe_ckpt.failures.protocol import EXIT_FENCED, fenced_key, hosted_store

    store = hosted_store("127.0.0.1", 0, timedelta(seconds=10))
    channel = job_channel(store)
    channel.set(TIMEOUT_KEY, "30.0")
    env = {**os.environ, ENV_STORE: f"127.0.0.1:{store.port}", "RANK": "0", "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-c", FENCED_WORKER], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert worker.stdout is not None and worker.stdin is not None
        pid = int(worker.stdout.readline())
        where = socket.gethostname() if host == "here" else "another-machine"
        channel.set(fenced_key(0, pid), json.dumps({"generation": 1, "host": where}))
        worker.stdin.write("\n")
        worker.stdin.flush()
        code = worker.wait(timeout=60)
    finally:
        worker.kill()
    if host == "here":
        assert code == EXIT_FENCED and int(store.add("gen1/arrived", 0)) == 0
    else:
        assert code == 0 and int(store.add("gen1/arrived", 0)) == 1
