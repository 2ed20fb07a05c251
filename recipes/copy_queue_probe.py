"""Does a snapshot's device-to-host copy hold up the training stream's own reads?

``python recipes/copy_queue_probe.py [--gib 4] [--tensors 250] [--read pinned]`` (needs
CUDA) stands in for one iteration of a MoE model: 16 "layers" of two 4096x4096 matmuls on
the current stream, each ending in a small read of the routing counts a MoE layer needs on
the host: ``.tolist()`` into pageable memory (``--read pageable``, the default, as most
models do), or a non-blocking copy into a pinned buffer and a wait on its event
(``--read pinned``), to tell whether the kind of read decides if it waits behind a
snapshot's copy.
Meanwhile another thread copies ``--gib`` GiB in ``--tensors`` tensors to pinned host
memory on a side stream, either issued at once or in the snapshot capture's batches
(:class:`~lightning_moe_ckpt.snapshots.copy_batches.CopyBatches`, a ring of events
bounding how many are queued). It prints how much longer the "iteration" took than
without a copy, the longest single read, and the copy's achieved GB/s, beside the
iteration and alone.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from lightning_moe_ckpt.snapshots.copy_batches import CopyBatches


def iteration(weights: torch.Tensor, counts: torch.Tensor, pinned: torch.Tensor | None = None,
              layers: int = 16) -> tuple[float, float]:
    """Seconds of one stand-in iteration, and its longest read of ``counts`` (through the
    ``pinned`` buffer when given, else ``.tolist()``)."""
    longest = 0.0
    started = time.perf_counter()
    read_done = torch.cuda.Event()
    for _ in range(layers):
        for _ in range(2):
            weights.mm(weights)
        read = time.perf_counter()
        if pinned is None:
            counts.tolist()
        else:
            pinned.copy_(counts, non_blocking=True)
            read_done.record()
            read_done.synchronize()
            pinned.tolist()
        longest = max(longest, time.perf_counter() - read)
    torch.cuda.synchronize()
    return time.perf_counter() - started, longest


def copy(targets: list[torch.Tensor], batches: CopyBatches, in_flight: int,
         stream: torch.cuda.Stream, out: dict[str, float]) -> None:
    """Copy on ``stream`` in ``batches``, at most ``in_flight`` queued, as the snapshot
    engine's copy thread does; ``out['seconds']`` is the copy's time on the stream."""
    started = torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(enable_timing=True, blocking=True)
    ring = [torch.cuda.Event(blocking=True) for _ in range(in_flight)]
    with torch.cuda.stream(stream):
        started.record()
        batches.issue(targets, ring)
        done.record()
    done.synchronize()
    out["seconds"] = started.elapsed_time(done) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="bytes copied, GiB")
    parser.add_argument("--tensors", type=int, default=250, help="tensors copied")
    parser.add_argument("--read", choices=("pageable", "pinned"), default="pageable",
                        help="how the iteration reads its counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_queue_probe.py needs CUDA")
    numel = int(args.gib * 2**30) // args.tensors // 4
    sources = [torch.randn(numel, device="cuda") for _ in range(args.tensors)]
    targets = [torch.empty(numel, pin_memory=True) for _ in range(args.tensors)]
    nbytes = numel * 4 * args.tensors
    weights = torch.randn(4096, 4096, device="cuda")
    counts = torch.zeros(17, dtype=torch.int64, device="cuda")
    pinned = (torch.empty(17, dtype=torch.int64, pin_memory=True) if args.read == "pinned"
              else None)
    stream = torch.cuda.Stream()
    for _ in range(2):
        iteration(weights, counts, pinned)
    alone, alone_longest = iteration(weights, counts, pinned)
    print(f"{args.read} reads, no copy: iteration {alone * 1e3:.1f} ms, longest read "
          f"{alone_longest * 1e3:.2f} ms")
    print("| copy issued | iteration ms | vs no copy | longest read ms | copy GB/s | "
          "copy GB/s, alone |")
    print("|---|---|---|---|---|---|")
    cases: list[tuple[str, int | None, int]] = [("at once", None, 1)] + [
        (f"{mib} MiB batches, {depth} queued", mib * 2**20, depth)
        for mib, depth in ((64, 2), (32, 2), (16, 2), (8, 2), (8, 4))]
    for name, batch_bytes, depth in cases:
        batches = CopyBatches.of(sources, batch_bytes)  # None: one batch, at once
        # The copy without the iteration beside it: whether the batches or the compute
        # beside them set its speed.
        alone_out: dict[str, float] = {}
        copy(targets, batches, depth, stream, alone_out)
        for _ in range(2):
            out: dict[str, float] = {}
            worker = threading.Thread(target=copy, args=(targets, batches, depth, stream, out))
            torch.cuda.synchronize()
            worker.start()
            time.sleep(0.002)  # the copy is queued first, as after an optimizer step
            took, longest = iteration(weights, counts, pinned)
            worker.join()
            print(f"| {name} | {took * 1e3:.1f} | {took / alone:.3f} | {longest * 1e3:.2f} | "
                  f"{nbytes / out['seconds'] / 1e9:.1f} | "
                  f"{nbytes / alone_out['seconds'] / 1e9:.1f} |")
        assert all(torch.equal(s.cpu(), t) for s, t in zip(sources[:3], targets[:3],
                                                            strict=True))


if __name__ == "__main__":
    main()
