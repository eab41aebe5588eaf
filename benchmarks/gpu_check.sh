#!/usr/bin/env bash
# The device check, for a session that is lent a GPU: one short script that exercises the CUDA /
# NCCL paths of every lesson at world size 1 in bf16 and measures tokens/s and MFU. Its output
# goes to $OUT (or /tmp) and its figures into benchmarks/RESULTS.md with the date and the GPU.
#
#   bash benchmarks/gpu_check.sh            # about 4 minutes on one H200
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
out=${OUT:-/tmp}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/gpu_check.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/gpu_check.txt"

# The fast paths' CUDA-only comparisons (the fused ring block in bf16 against the plain one, fused
# AdamW) are tests that skip without a GPU.
python3 -m pytest -q tests/test_fast_paths.py 2>&1 | tail -3 | tee -a "$out/gpu_check.txt"

run() {
  echo "== $*" | tee -a "$out/gpu_check.txt"
  timeout 120 torchrun --standalone --nproc_per_node=1 "$@" 2>&1 | grep -v '^W[0-9]' | tee -a "$out/gpu_check.txt"
}

# 125M-parameter shape, 16 x 1024 tokens per step: big enough for MFU to mean something.
run 01_data_parallel.py --preset 125m --seq-len 1024 --micro-batch-size 16 --grad-accum 1 --steps 30 --warmup-steps 3 --lr 6e-4 --dtype bfloat16
run 01_data_parallel.py --preset 1b --seq-len 2048 --micro-batch-size 4 --grad-accum 1 --steps 15 --warmup-steps 3 --lr 3e-4 --dtype bfloat16
# The other lessons at degree 1: their CUDA code paths (vocab-parallel loss, pipeline executor,
# ring attention's block kernels) on one GPU, 125m shape, bf16.
common="--preset 125m --seq-len 1024 --micro-batch-size 8 --steps 15 --warmup-steps 3 --lr 6e-4 --dtype bfloat16"
run 02_tensor_parallel.py --tp 1 --dp 1 --grad-accum 1 $common
run 03_pipeline_parallel.py --pp 1 --micro-batches 2 $common
run 04_context_parallel.py --cp 1 --grad-accum 1 $common
# Lesson 05 at ep = 1 (tiny-moe at a longer sequence: the grouped bf16 kernel and the MoE step on
# CUDA), then looped against grouped experts in bf16.
run 05_expert_parallel.py --ep 1 --preset tiny-moe --seq-len 1024 --micro-batch-size 8 --grad-accum 1 --steps 15 --warmup-steps 3 --dtype bfloat16 --aux-loss-coef 1e-2
run benchmarks/moe_grouped_vs_loop.py --ep-degrees 1 --preset tiny-moe --n-layers 8 --seq-len 1024 --dtype bfloat16
# Lesson 07 at world size 1: the trainer's CUDA paths (ZeRO's flat bf16 buffers, recomputation),
# then its overhead against a plain loop and each recompute mode's time and memory.
run 07_full_5d.py --zero-stage 1 --recompute selective $common --grad-accum 1
run benchmarks/trainer_overhead.py --preset 125m --seq-len 1024 --micro-batch-size 8 --grad-accum 1 --steps 12 --dtype bfloat16

# ---- one 8-GPU node (B300, H100 or H200): lesson 07 with the 8b preset in layouts that fit ----
# Each rank builds its share of the reference model on the CPU before moving it to its GPU (a
# minute or two, and up to 32 GB of host memory per rank for the tp-only layout).
if [ "$(nvidia-smi -L | wc -l)" -ge 8 ]; then
  run8() {
    echo "== 8 GPUs: $*" | tee -a "$out/gpu_check.txt"
    timeout 900 torchrun --standalone --nproc_per_node=8 "$@" 2>&1 | grep -v '^W[0-9]' | tee -a "$out/gpu_check.txt"
  }
  big="--preset 8b --seq-len 4096 --micro-batch-size 1 --steps 12 --warmup-steps 2 --lr 3e-4 --dtype bfloat16"
  # dp 2 x pp 2 x tp 2 with sequence parallelism, ZeRO-1, selective recompute: ~20 GB of model
  # states per rank, activations of two live micro-batches on the first stage.
  run8 07_full_5d.py --dp 2 --pp 2 --tp 2 --sequence-parallel --zero-stage 1 --recompute selective --grad-accum 4 $big
  # dp 2 x pp 4, interleaved over 2 chunks of 4 layers per rank, ZeRO-1, selective recompute: the
  # memory plan gives the first stage 50 GiB (11 chunk micro-batches live at its peak).
  run8 07_full_5d.py --dp 2 --pp 4 --schedule interleaved --virtual-stages 2 --zero-stage 1 --recompute selective --grad-accum 8 $big
  # dp 8, ZeRO-3, full recompute: 16 GB of model states per rank, weights gathered per block.
  run8 07_full_5d.py --dp 8 --zero-stage 3 --recompute full --grad-accum 1 $big
fi
