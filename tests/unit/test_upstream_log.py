"""UpstreamLog: bitwise host copies, exact tagging, freeing by iteration, loss on failure."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from lightning_moe_ckpt.parallel.pipeline import BoundaryEvent, BoundaryHook
from lightning_moe_ckpt.recovery import LogBufferPool, UpstreamLog


def _tensor(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _event(kind: Literal["activation", "gradient"], iteration: int, mb: int, stage: int,
           *tensors: torch.Tensor | None) -> BoundaryEvent:
    return BoundaryEvent(kind, iteration, mb, stage, tuple(tensors))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_holds_bitwise_copies_unaffected_by_later_mutation(dtype: torch.dtype) -> None:
    log = UpstreamLog()
    act, grad = _tensor(1, dtype), _tensor(2, dtype)
    expected_act, expected_grad = act.clone(), grad.clone()
    log(_event("activation", 3, 0, 1, act))
    log(_event("gradient", 3, 0, 1, grad, None))
    act.add_(1.0)  # the pipeline may reuse or change its buffers after the send
    grad.zero_()
    (logged_act,) = log.activations(3, 1)[0]
    logged_grad, missing = log.gradients(3, 1)[0]
    assert logged_act is not None and logged_grad is not None
    assert logged_act.dtype == dtype and logged_act.device.type == "cpu"
    assert torch.equal(logged_act, expected_act)
    assert torch.equal(logged_grad, expected_grad)
    assert missing is None  # a None gradient (zeros sent) stays None
    assert log.nbytes() == 2 * _nbytes(expected_act)


def test_lookups_return_exactly_the_tagged_entries() -> None:
    log = UpstreamLog()
    sent = {}
    for it in (0, 1):
        for stage in (0, 1):
            for mb in range(3):
                t = _tensor(100 * it + 10 * stage + mb)
                sent[("activation", it, stage, mb)] = t.clone()
                log(_event("activation", it, mb, stage, t))
    log(_event("gradient", 1, 2, 1, _tensor(999)))
    acts = log.activations(1, 0)
    assert list(acts) == [0, 1, 2]
    for mb, (tensor,) in acts.items():
        assert tensor is not None and torch.equal(tensor, sent[("activation", 1, 0, mb)])
    assert log.activations(2, 0) == {} and log.activations(1, 5) == {}
    assert list(log.gradients(1, 1)) == [2]
    assert log.gradients(1, 0) == {} and log.gradients(0, 1) == {}
    assert log.iterations() == [0, 1]


def test_evaluation_events_are_never_logged() -> None:
    log = UpstreamLog()
    log(_event("activation", -1, 0, 0, _tensor(0)))
    log.log_inputs(-1, _tensor(1), None)
    log.log_scalars(-1, 0.5, 1.0, 1e-3)
    assert log.nbytes() == 0 and log.iterations() == []


def test_inputs_labels_and_scalars() -> None:
    log = UpstreamLog()
    tokens = torch.randint(0, 256, (4, 2, 16), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(1, dims=-1)
    log.log_inputs(5, tokens, None)  # stage 0 has no labels
    log.log_inputs(6, None, labels)  # the last stage has no inputs
    tokens.zero_()
    labels.zero_()
    batch5, batch6 = log.inputs(5), log.inputs(6)
    assert batch5 is not None and batch6 is not None and log.inputs(7) is None
    assert batch5.targets is None and batch6.inputs is None
    assert batch5.inputs is not None and batch6.targets is not None
    expected = torch.randint(0, 256, (4, 2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch5.inputs, expected)
    assert torch.equal(batch6.targets, expected.roll(1, dims=-1))

    clip = torch.tensor(0.37, dtype=torch.float32)
    log.log_scalars(5, clip, 1.0, 3e-4)
    clip.fill_(1.0)  # the log keeps the value of iteration 5, not the live tensor
    scalars = log.scalars(5)
    assert scalars is not None and log.scalars(6) is None
    assert isinstance(scalars.clip_coef, torch.Tensor)
    assert torch.equal(scalars.clip_coef, torch.tensor(0.37, dtype=torch.float32))
    assert scalars.loss_scale == 1.0 and scalars.lr == 3e-4
    assert log.nbytes() == 2 * _nbytes(expected) + _nbytes(clip)


def test_release_before_frees_older_iterations_and_their_bytes() -> None:
    log = UpstreamLog()
    per_iteration = 0
    for it in range(4):
        act, grad, tokens = _tensor(it), _tensor(10 + it), torch.zeros(4, 16, dtype=torch.long)
        log(_event("activation", it, 0, 0, act))
        log(_event("gradient", it, 0, 1, grad))
        log.log_inputs(it, tokens, None)
        log.log_scalars(it, torch.tensor(1.0), 1.0, 1e-3)
        per_iteration = _nbytes(act) + _nbytes(grad) + _nbytes(tokens) + 4
    assert log.nbytes() == 4 * per_iteration
    log.release_before(2)
    assert log.iterations() == [2, 3]
    assert log.nbytes() == 2 * per_iteration
    assert log.activations(1, 0) == {} and log.gradients(0, 1) == {}
    assert log.inputs(1) is None and log.scalars(0) is None
    assert torch.equal(log.activations(2, 0)[0][0], _tensor(2))  # type: ignore[arg-type]
    log.release_before(2)  # idempotent
    assert log.nbytes() == 2 * per_iteration


def test_drop_loses_everything() -> None:
    log = UpstreamLog()
    log(_event("activation", 0, 0, 0, _tensor(0)))
    log.log_inputs(0, torch.zeros(2, 3, dtype=torch.long), None)
    log.log_scalars(0, 0.5, 1.0, 1e-3)
    log.drop()
    assert log.nbytes() == 0 and log.iterations() == []
    assert log.activations(0, 0) == {} and log.inputs(0) is None and log.scalars(0) is None


def test_relogging_an_entry_replaces_it() -> None:
    # Replay regenerates the entries a failed neighbour lost: no duplicates, no growth.
    log = UpstreamLog()
    log(_event("activation", 4, 1, 0, _tensor(0)))
    before = log.nbytes()
    log(_event("activation", 4, 1, 0, _tensor(1)))
    assert log.nbytes() == before
    assert torch.equal(log.activations(4, 0)[1][0], _tensor(1))  # type: ignore[arg-type]


def test_attach_registers_the_log_as_a_boundary_hook() -> None:
    hooks: list[BoundaryHook] = []
    log = UpstreamLog()
    log.attach(hooks)
    assert hooks == [log]
    for hook in hooks:
        hook(_event("activation", 0, 0, 0, _tensor(0)))
    assert list(log.activations(0, 0)) == [0]


def test_log_buffer_pool_reuses_released_buffers() -> None:
    pool = LogBufferPool(pin_memory=False)
    first = pool.acquire(_tensor(0))
    pool.release(first)
    assert pool.spare_bytes == _nbytes(first)
    assert pool.acquire(_tensor(1)) is first
    assert pool.spare_bytes == 0
    other = pool.acquire(_tensor(2, torch.bfloat16))  # another dtype: a new buffer
    assert other is not first and other.dtype == torch.bfloat16
    assert pool.allocated_bytes == _nbytes(first) + _nbytes(other)


def test_cpu_logging_reuses_pooled_buffers_once_released() -> None:
    # Steady-state logging allocates nothing: each iteration's sends, inputs and scalars
    # go into the buffers the released iterations gave back.
    log = UpstreamLog(pin_memory=False)
    buffers = []
    for it in range(3):
        log.release_before(it)
        log(_event("activation", it, 0, 0, _tensor(it)))
        log.log_inputs(it, torch.full((4, 16), it, dtype=torch.long), None)
        log.log_scalars(it, torch.tensor(0.5 + it), 1.0, 1e-3)
        if it == 0:
            allocated = log.pool.allocated_bytes
        (act,) = log.activations(it, 0)[0]
        batch = log.inputs(it)
        scalars = log.scalars(it)
        assert act is not None and batch is not None and scalars is not None
        assert torch.equal(act, _tensor(it))
        assert batch.inputs is not None and bool((batch.inputs == it).all())
        assert torch.equal(torch.as_tensor(scalars.clip_coef), torch.tensor(0.5 + it))
        buffers.append(act.data_ptr())
        # The iteration took back every spare the one before it released.
        assert log.pool.spare_bytes == 0 and log.host_bytes() == log.nbytes() == allocated
    assert allocated == _nbytes(_tensor(0)) + 4 * 16 * 8 + 4
    assert log.pool.allocated_bytes == allocated  # nothing allocated after the first
    assert buffers[1] == buffers[0] and buffers[2] == buffers[0]
    log.release_before(3)  # released buffers are spares the log still occupies
    assert log.nbytes() == 0 and log.host_bytes() == log.pool.spare_bytes == allocated


def test_a_non_contiguous_cpu_send_is_logged_with_its_strides() -> None:
    log = UpstreamLog(pin_memory=False)
    sent = _tensor(5).transpose(1, 2)
    log(_event("gradient", 0, 0, 1, sent))
    (logged,) = log.gradients(0, 1)[0]
    assert logged is not None and torch.equal(logged, sent)
    assert logged.stride() == sent.stride() and logged.data_ptr() != sent.data_ptr()
    assert log.pool.allocated_bytes == 0  # cloned, not pooled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_are_asynchronous_pinned_and_exact() -> None:
    log = UpstreamLog()
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    source = a @ a  # still running on the main stream when the hook fires
    log(_event("activation", 0, 0, 0, source))
    log.wait()
    (copy,) = log.activations(0, 0)[0]
    assert copy is not None and copy.is_pinned() and torch.equal(copy, source.cpu())
    allocated = log.pool.allocated_bytes
    log.release_before(1)
    log(_event("activation", 1, 0, 0, torch.ones(2048, 2048, device=device)))
    assert log.pool.allocated_bytes == allocated  # the pinned buffer was reused
    (again,) = log.activations(1, 0)[0]
    assert again is not None and bool((again == 1).all())
