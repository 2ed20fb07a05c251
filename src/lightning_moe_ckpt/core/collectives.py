"""Collectives of plain values among the job's ranks, without pickle.

``torch.distributed``'s ``*_object`` collectives pickle what they send and unpickle what
they receive: any process that can reach the group could make every rank run code. These
send :mod:`~lightning_moe_ckpt.core.wire` values instead (None, numbers, strings, bytes,
lists, tuples, dicts, CPU tensors), as a length and a byte tensor per rank, on the
group's device (the current CUDA device under NCCL, else the CPU). A value of another type
is refused before anything is sent, naming where it sits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_moe_ckpt.core.wire import dumps, loads

__all__ = ["all_gather_values", "broadcast_value", "gather_values"]


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encoded(value: Any, device: torch.device) -> torch.Tensor:
    data = dumps(value, "a value sent to the other ranks")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decoded(data: torch.Tensor, length: int) -> Any:
    return loads(data[:length].cpu().numpy().tobytes())


def all_gather_values(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` (collective over ``group``), in rank order."""
    device = _device(group)
    data = _encoded(value, device)
    world = dist.get_world_size(group)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [_decoded(block, size) for block, size in zip(gathered, sizes, strict=True)]


def broadcast_value(value: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``value`` on every rank (collective; ``src`` is a global rank)."""
    device = _device(group)
    mine = dist.get_rank() == src
    data = _encoded(value, device) if mine else torch.empty(0, dtype=torch.uint8,
                                                           device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if not mine:
        data = torch.empty(int(length), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return _decoded(data, int(length))


def gather_values(value: Any, dst: int = 0,
                  group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``value`` on rank ``dst`` (a global rank), in rank order; ``None`` on
    the other ranks (collective)."""
    device = _device(group)
    data = _encoded(value, device)
    world = dist.get_world_size(group)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)  # every rank pads to the longest
    sizes = [int(n) for n in torch.cat(lengths).tolist()]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    receiving = dist.get_rank() == dst
    gathered = [torch.empty_like(padded) for _ in range(world)] if receiving else None
    dist.gather(padded, gathered, dst=dst, group=group)
    if gathered is None:
        return None
    return [_decoded(block, size) for block, size in zip(gathered, sizes, strict=True)]
