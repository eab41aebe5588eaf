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
