#!/usr/bin/env bash
# GPU checks on one CUDA machine: `bash recipes/gpu_check.sh [OUT_DIR [CHECK...]]`, the
# checks by name (default: all, in this order):
#
#   tests        the CUDA tests: tests/gpu (pinned side-stream snapshots, and the training
#                recipe through an injected failure, bit for bit against the fault-free
#                run, with both APIs) and the CUDA cases of tests/unit;
#   bandwidth    pinned and pageable device-to-host copy bandwidth of a 1 GiB buffer;
#   copy_queue   recipes/copy_queue_probe.py: how long the training stream's small reads
#                wait behind a 4 GiB snapshot copy issued at once or in batches, read
#                into pageable memory (.tolist()) and then into a pinned buffer;
#   bench_tiny   `recipes/bench.py hardware=h100` on this one GPU with the tiny model: the
#                path runs end to end;
#   bench_sized  the same on a model sized to the GPU (the paper's GPT-MoE widths, 2 layers
#                of 16 experts, 0.8B parameters, sequences of 1024): iteration time against
#                checkpoint=none, stall, snapshot bytes, and the snapshot copies' achieved
#                GB/s next to the pinned bandwidth the run's profile measured;
#   helper_nice  (by name only, not in the default list) moevement on the sized model with
#                its helper threads at the training threads' priority
#                (checkpoint.helper_nice=0), to set beside bench_sized's default 19.
#
# Uses the python3 on PATH with the package from src/ (no install). Every check has its own
# time limit and writes its log to OUT_DIR; a failing check does not stop the next one.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/gpu_check}
shift $(($# > 0 ? 1 : 0))
checks=" ${*:-tests bandwidth copy_queue bench_tiny bench_sized} "
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

wanted() { [[ $checks == *" $1 "* ]]; }

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc, $((SECONDS - started)) s"
    tail -n 25 "$out/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
      --format=csv; python3 -c "import torch, lightning; print('torch', torch.__version__,
'lightning', lightning.__version__, torch.cuda.get_device_name(0))"; date -u; } \
    >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

wanted tests && step cuda_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    -o addopts="" -ra tests/gpu tests/unit/test_planners.py tests/unit/test_upstream_log.py

wanted bandwidth && step copy_bandwidth 60 python3 - <<'EOF'
import torch
from lightning_moe_ckpt.planning.profiler import measure_bandwidth

nbytes = 2**30
pinned = measure_bandwidth(nbytes, "cuda", repeats=5)
source = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
pageable = torch.zeros(nbytes, dtype=torch.uint8)
best = float("inf")
for _ in range(3):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pageable.copy_(source)
    stop.record()
    stop.synchronize()
    best = min(best, start.elapsed_time(stop) / 1e3)
print(f"device-to-host, 1 GiB: pinned {pinned / 1e9:.1f} GB/s, "
      f"pageable {nbytes / best / 1e9:.1f} GB/s")
EOF

wanted copy_queue && step copy_queue 120 python3 recipes/copy_queue_probe.py
wanted copy_queue && step copy_queue_pinned 120 python3 recipes/copy_queue_probe.py --read pinned

bench=(python3 recipes/bench.py --ettr-policies none --peers none --policies moevement gemini)
wanted bench_tiny && step bench_tiny 150 "${bench[@]}" --steps 40 --out "$out/bench_tiny" \
    hardware=h100
# 60 steps: the first two windows pin their host buffers (seconds a step), and the median
# counts every step, so a 30-step run at W = 4 was a third start-up.
sized=(hardware=h100 model=gpt_moe model.n_layers=2 model.n_experts=16 model.max_seq_len=1024
       data.seq_len=1024)
wanted bench_sized && step bench_sized 420 "${bench[@]}" --steps 60 --out "$out/bench_sized" \
    "${sized[@]}"
wanted helper_nice && step helper_nice 300 python3 recipes/bench.py --policies moevement --ettr-policies none --peers none \
    --steps 60 --out "$out/helper_nice" "${sized[@]}" "moevement:checkpoint.helper_nice=0"

exit $status
