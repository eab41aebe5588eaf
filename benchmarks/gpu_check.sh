# The device check, for a session that is lent one GPU for about 15 minutes of device time (the
# machine's start included): one prepared command, a ranked list of rows, the most valuable first,
# that measures what a CPU cannot (kernels, NCCL, lesson 07's step) and proves the CUDA paths run.
# It installs nothing.
#
#   bash benchmarks/gpu_check.sh                 # ~6 minutes on one H100 or H200; GPU_CHECK_BUDGET_S=330
#   GPU_CHECK_OUT=/tmp/gc bash benchmarks/gpu_check.sh
#
# Each row has its own timeout; a failed row is recorded and the script goes on, and it exits
# non-zero if any failed. After GPU_CHECK_BUDGET_S seconds no new row starts (those left are listed
# as skipped), and no row outlasts the budget by more than 60 s, so that one device call leaves time
# for a second. Everything lands in GPU_CHECK_OUT (default $OUT/gpu_check, or /tmp/gpu_check), as each
# row finishes (a device call cut short keeps the rows before): the whole log gpu_check.log, one line
# per finished row in rows.tsv (name, exit code, seconds), each row's output NAME.txt, and for lesson
# 07's runs their --metrics file NAME.metrics.jsonl and the memory and step-time plan for the same
# flags NAME.plan.txt; the log ends with a table of tokens/s, MFU and peak memory next to the plan
# (benchmarks/gpu_check_table.py). Rows that a CPU already proves (the gloo tests) are not here.
# On a node of 8 GPUs it goes on: every lesson and some lesson 07 layouts in float32 against lesson 07
# on one GPU (a pass/fail table: NCCL equal to one device), then lesson 07 with the 8b preset.
# Copy its figures into benchmarks/RESULTS.md with the date and the GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${GPU_CHECK_OUT:-${OUT:-/tmp}/gpu_check}
budget=${GPU_CHECK_BUDGET_S:-330}
mkdir -p "$out"
log="$out/gpu_check.log"
failed=() skipped=()

say() { echo "$*" | tee -a "$log"; }

# run NAME TIMEOUT_S COMMAND...: the command's whole output to NAME.txt, its end to the log, and one
# line to rows.tsv when it finishes.
run() {
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [ "$SECONDS" -ge "$budget" ]; then
    skipped+=("$name"); say "== $name: skipped (budget of $budget s spent)"
    printf '%s\tskipped\t0\n' "$name" >>"$out/rows.tsv"; return
  fi
  [ "$limit" -le $((budget + 60 - SECONDS)) ] || limit=$((budget + 60 - SECONDS))
  say "== $name: $*"
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  grep -v '^W[0-9]\|^\[W' "$out/$name.txt" | tail -n 14 | tee -a "$log"
  say "-- $name: exit $rc after $((SECONDS - start)) s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$out/rows.tsv"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

# one_gpu NAME TIMEOUT_S SCRIPT FLAGS...: torchrun with one rank and a --metrics file.
one_gpu() {
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" torchrun --standalone --nproc_per_node=1 "$@" --metrics "$out/$name.metrics.jsonl"
}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
plan_gpu=H100
for known in B300 B200 H200 H100 A100; do case "$gpu" in *"$known"*) plan_gpu=$known; break;; esac; done
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
sm=$(python3 -c 'import torch; print(torch.cuda.get_device_capability(0)[0])')

# Lesson 07's runs: 1b in bf16 at sequence 2048 (8,192 tokens per step), then a 2-layer Mixtral.
b1="--preset 1b --seq-len 2048 --micro-batch-size 4 --grad-accum 1 --steps 10 --warmup-steps 2 --lr 3e-4 --dtype bfloat16"
moe="--preset mixtral-8x7b --n-layers 2 --seq-len 2048 --micro-batch-size 2 --grad-accum 1 --steps 8 --warmup-steps 2 --lr 3e-4 --dtype bfloat16 --zero-stage 1"
declare -A flags=(
  [07-1b-compile]="$b1 --zero-stage 0 --recompute none --compile"
  [07-1b-compile-mb8]="$b1 --micro-batch-size 8 --zero-stage 0 --recompute none --compile"   # the later flag wins
  [07-1b-compile-muon]="$b1 --zero-stage 0 --recompute none --compile --optimizer muon --muon-lr 0.01"
  [07-1b-fp8-rowwise-compile]="$b1 --zero-stage 0 --recompute none --compile --fp8 rowwise"
  [07-1b-fp8-rowwise-all-compile]="$b1 --zero-stage 0 --recompute none --compile --fp8 rowwise --no-fp8-shape-rule"
  [07-1b-fp8-mxfp8-compile]="$b1 --zero-stage 0 --recompute none --compile --fp8 mxfp8"
  [07-1b-eager]="$b1 --zero-stage 0 --recompute none"
  [07-1b-eager-offload-activations]="$b1 --zero-stage 0 --recompute none --offload activations"
  [07-1b-compile-offload-optimizer]="$b1 --zero-stage 0 --recompute none --compile --offload optimizer"
  [07-1b-zero3]="$b1 --zero-stage 3 --recompute none"
  [07-moe-grouped]="$moe --grouped-mm"
  [07-moe-looped]="$moe --no-grouped-mm"
  [07-1b-selective]="$b1 --zero-stage 0 --recompute selective"
  [07-1b-full]="$b1 --zero-stage 0 --recompute full"
  [07-125m-float32]="--preset 125m --seq-len 1024 --micro-batch-size 8 --grad-accum 1 --steps 8 --warmup-steps 2 --dtype float32 --zero-stage 1"
  [07-1b-compile-selective]="$b1 --zero-stage 0 --recompute selective --compile"
)
# The plans need no GPU: they run on the host beside the first rows.
(for name in "${!flags[@]}"; do
   # shellcheck disable=SC2086
   python3 07_full_5d.py --plan --gpus 1 --gpu "$plan_gpu" ${flags[$name]} >"$out/$name.plan.txt" 2>&1
 done) &
plans=$!

# ---- the ranked list (one GPU) ----
# 1. Lesson 07's step as users run it (the 1b preset with --compile): the MFU goal, against the
#    first H200 run's 43.1 %, and the step-time model's estimate beside it (the table).
one_gpu 07-1b-compile 240 07_full_5d.py ${flags[07-1b-compile]}
# 2-5. Where issue 37 says the step's time goes, each new path against the one it replaces:
#    the head and loss (full logits, chunked eager, chunked compiled; ms and peak), the step's tail
#    (CUDA events per part), each SDPA backend, and FP8 per linear (bf16, tensorwise, rowwise, fast
#    accumulation on and off, 1b and 8b shapes, and which GEMMs the shape rule keeps in bf16).
run loss 120 python3 benchmarks/gpu_loss.py
run tail 90 python3 benchmarks/gpu_tail.py
run attention 90 python3 benchmarks/gpu_attention.py
run fp8-linear 150 python3 benchmarks/gpu_fp8_linear.py
# 6. FP8 on the whole step next to its bf16 twin (the table's "vs twin": the 1.1x goal on Hopper),
#    with the shape rule (at 1b most GEMMs stay bf16) and without it (every linear in FP8: "-all");
#    on sm_100+ first the block-scaled mxfp8 kernel against lesson 07's emulation, then mxfp8.
one_gpu 07-1b-fp8-rowwise-compile 240 07_full_5d.py ${flags[07-1b-fp8-rowwise-compile]}
one_gpu 07-1b-fp8-rowwise-all-compile 240 07_full_5d.py ${flags[07-1b-fp8-rowwise-all-compile]}
if [ "$sm" -ge 10 ]; then
  run fp8-mx-kernel 60 python3 benchmarks/fp8_mx_kernel_check.py
  one_gpu 07-1b-fp8-mxfp8-compile 240 07_full_5d.py ${flags[07-1b-fp8-mxfp8-compile]}
fi
# 7. This GPU's own device profile (issue 36's model, calibrated): GEMMs, attention, bandwidth and
#    per-op time measured (one rank: the links are the published ones); the plans again from it, so the
#    table sets each run's tokens/s beside both estimates.
run calibrate 150 torchrun --standalone --nproc_per_node=1 07_full_5d.py --calibrate "$out/device_profile.json"
if [ -s "$out/device_profile.json" ]; then
  (for name in "${!flags[@]}"; do
     # shellcheck disable=SC2086
     python3 07_full_5d.py --plan --gpus 1 --device-profile "$out/device_profile.json" ${flags[$name]} \
       >"$out/$name.calibrated.plan.txt" 2>&1
   done) &
  calibrated_plans=$!
fi
# 8. A larger micro-batch: the GEMMs' M doubles (the step-time model prices that; here it is measured).
one_gpu 07-1b-compile-mb8 240 07_full_5d.py ${flags[07-1b-compile-mb8]}
# 8b. Muon (06_zero_muon) on the same step: one rank owns every matrix, so the step line's time
#    less 07-1b-compile's is the whole Newton-Schulz in bf16, against the plan's `of which Muon's step`.
one_gpu 07-1b-compile-muon 240 07_full_5d.py ${flags[07-1b-compile-muon]}
# 8c. Memory beyond the GPU (issue 39), each against its twin without it: ZeRO-Offload (06_zero_offload:
#    the master and AdamW's states in pinned host memory, the step by the host's fused CPU AdamW) and
#    activation offload (the kept tensors of every block but the last to the host and back). The table
#    gives each one's tokens/s over its twin's ("vs twin"), both peaks, and below it every step's loss
#    against the twin's: the host AdamW within 5e-3 relative of the fused CUDA AdamW's, activation
#    offload within 1e-3 (the copies are exact; only the attention backward's own nondeterminism).
#    ZeRO-Offload's twin is row 1 (at one rank ZeRO-0 and ZeRO-1 hold the same one shard).
# shellcheck disable=SC2086
for name in 07-1b-compile-offload-optimizer 07-1b-eager 07-1b-eager-offload-activations; do
  one_gpu "$name" 180 07_full_5d.py ${flags[$name]}
done
# 9. NCCL's silent failures: a short run whose every collective is recorded and checked at the end
#    (the same sequence on every member, and no step collective on a CPU tensor of this CUDA run).
PICOTRON_LIKE_CHECK_COLLECTIVES=1 one_gpu 07-collectives-checked 120 07_full_5d.py --preset 125m --seq-len 1024 \
  --micro-batch-size 4 --grad-accum 2 --steps 4 --warmup-steps 1 --dtype bfloat16 --zero-stage 1 --val-every 2
# 10. The CUDA-only tests (the fused paths' equality to the exact ones on the GPU).
run tests-cuda 120 python3 -m pytest -q -k cuda tests/test_fast_paths.py tests/test_train.py tests/test_loss_memory.py
# 11. The MoE step: grouped experts against the loop, and the host reads per step.
one_gpu 07-moe-grouped 240 07_full_5d.py ${flags[07-moe-grouped]}
one_gpu 07-moe-looped 240 07_full_5d.py ${flags[07-moe-looped]}
run syncs-07-moe 90 torchrun --standalone --nproc_per_node=1 benchmarks/count_host_syncs.py 07_full_5d.py \
  --preset tiny-moe --seq-len 1024 --micro-batch-size 8 --grad-accum 2 --steps 6 --dtype bfloat16 --zero-stage 1
# 12. The modes the first H200 run measured, again (eager is 8c's twin): ZeRO-3, the recompute modes, float32.
# shellcheck disable=SC2086
for name in 07-1b-zero3 07-1b-selective 07-1b-full 07-125m-float32; do
  one_gpu "$name" 180 07_full_5d.py ${flags[$name]}
done
# 13. Every lesson at degree 1: its CUDA code paths (vocab-parallel loss, pipeline executor, ring
#    attention's block kernels, the MoE step with grouped bf16 experts, ZeRO's flat buffers).
small="--preset 125m --seq-len 1024 --micro-batch-size 8 --steps 6 --warmup-steps 2 --lr 6e-4 --dtype bfloat16"
one_gpu 01-dp 120 01_data_parallel.py $small --grad-accum 2
one_gpu 02-tp 120 02_tensor_parallel.py --tp 1 $small --grad-accum 1
one_gpu 03-pp 120 03_pipeline_parallel.py --pp 1 --micro-batches 2 $small
one_gpu 04-cp 120 04_context_parallel.py --cp 1 $small --grad-accum 1
one_gpu 05-ep 120 05_expert_parallel.py --ep 1 --preset tiny-moe --seq-len 1024 --micro-batch-size 8 --grad-accum 1 \
  --steps 6 --warmup-steps 2 --dtype bfloat16 --aux-loss-coef 1e-2
one_gpu 06-zero 120 06_zero.py --zero-stage 3 $small --grad-accum 1
# 14. --compile with selective recomputation: compiled once for all blocks (TORCH_LOGS shows every
#    recompilation and its reason; the first H200 run recompiled per block, fixed since).
TORCH_LOGS=recompiles one_gpu 07-1b-compile-selective 300 07_full_5d.py ${flags[07-1b-compile-selective]}

wait "$plans" ${calibrated_plans:-}
say ""
say "lesson 07 at world size 1 (medians after the first two steps; plan: --plan --gpus 1 --gpu $plan_gpu, same flags;"
say "calibrated: the same plan from this GPU's --calibrate profile):"
python3 benchmarks/gpu_check_table.py "$out" | tee -a "$log"

# ---- one 8-GPU node (B300, H100 or H200) ----
if [ "$(nvidia-smi -L | wc -l)" -ge 8 ]; then
  budget=$((SECONDS + ${GPU_CHECK_NODE_BUDGET_S:-2400}))     # a node's own budget, after the one-GPU part's
  eight() { local name=$1; shift; run "$name" 900 torchrun --standalone --nproc_per_node=8 "$@" --metrics "$out/$name.metrics.jsonl"; }
  four() { local name=$1; shift; run "$name" 900 torchrun --standalone --nproc_per_node=4 "$@" --metrics "$out/$name.metrics.jsonl"; }

  # Self-check: NCCL's collectives equal to one device. Only a real node can show it (NCCL will not
  # put two ranks on one GPU). Each lesson and a few lesson 07 layouts in float32 with TF32 off, and
  # lesson 07 on one GPU with the same seed, data and global batch (8 sequences of 1024 tokens), then
  # a pass/fail table of every step's loss and gradient norm (benchmarks/equal_to_one_device.py).
  export NVIDIA_TF32_OVERRIDE=0
  same="--seq-len 1024 --global-batch-tokens 8192 --micro-batch-size 1 --steps 6 --warmup-steps 2 --lr 3e-4 --dtype float32 --seed 0"
  dense="--preset 125m $same"          # 12 heads, 12 layers: tp 4, pp 4, cp up to 8
  moe="--preset tiny-moe $same"        # 4 experts: ep up to 4
  CUDA_VISIBLE_DEVICES=0 one_gpu equal-reference-dense 600 07_full_5d.py $dense
  CUDA_VISIBLE_DEVICES=0 one_gpu equal-reference-moe 600 07_full_5d.py $moe
  eight equal-01-dp8 01_data_parallel.py --dp 8 $dense
  eight equal-02-tp4-dp2-sp 02_tensor_parallel.py --tp 4 --dp 2 --sequence-parallel $dense
  eight equal-03-pp4-dp2 03_pipeline_parallel.py --pp 4 --dp 2 $dense
  eight equal-03-pp4-interleaved 03_pipeline_parallel.py --pp 4 --dp 2 --schedule interleaved $dense
  eight equal-04-cp8-ring 04_context_parallel.py --cp 8 $dense
  eight equal-04-cp4-dp2-ulysses 04_context_parallel.py --cp 4 --dp 2 --cp-mode ulysses $dense
  eight equal-06-zero3-dp8 06_zero.py --dp 8 --zero-stage 3 $dense
  eight equal-07-dp2-pp2-tp2-sp 07_full_5d.py --dp 2 --pp 2 --tp 2 --sequence-parallel --zero-stage 1 $dense
  eight equal-07-pp2-cp2-tp2-full 07_full_5d.py --pp 2 --cp 2 --tp 2 --zero-stage 1 --recompute full $dense
  eight equal-07-dp2-cp2-tp2-zero3 07_full_5d.py --dp 2 --cp 2 --tp 2 --cp-mode ulysses --zero-stage 3 $dense
  four equal-05-ep4 05_expert_parallel.py --ep 4 $moe
  eight equal-07-moe-dp4-ep4-tp2 07_full_5d.py --dp 4 --ep 4 --tp 2 --zero-stage 1 $moe
  unset NVIDIA_TF32_OVERRIDE
  say ""
  say "equal to one device (float32, TF32 off; every step's loss and gradient norm):"
  python3 benchmarks/equal_to_one_device.py "$out/equal-reference-dense.metrics.jsonl" \
    "$out"/equal-0[1-4]*.metrics.jsonl "$out"/equal-06*.metrics.jsonl "$out"/equal-07-[dp]*.metrics.jsonl \
    | tee -a "$log" || failed+=(equal-dense)
  # MoE at a looser tolerance: a token whose two best experts score within rounding of each other
  # may be routed differently, which moves the loss by ~1e-4 (the CPU proofs force the routing).
  python3 benchmarks/equal_to_one_device.py --rtol 1e-3 "$out/equal-reference-moe.metrics.jsonl" \
    "$out"/equal-05*.metrics.jsonl "$out"/equal-07-moe*.metrics.jsonl | tee -a "$log" || failed+=(equal-moe)

  # Speed: lesson 07 with the 8b preset in layouts that fit. Each rank builds its share of the
  # reference model on the CPU before moving it to its GPU (a minute or two, and up to 32 GB of host
  # memory per rank for the tp-only layout).
  big="--preset 8b --seq-len 4096 --micro-batch-size 1 --steps 12 --warmup-steps 2 --lr 3e-4 --dtype bfloat16"
  # dp 2 x pp 2 x tp 2 with sequence parallelism, ZeRO-1, selective recompute: ~20 GB of model
  # states per rank, activations of two live micro-batches on the first stage.
  eight 8gpu-dp2-pp2-tp2 07_full_5d.py --dp 2 --pp 2 --tp 2 --sequence-parallel --zero-stage 1 --recompute selective --grad-accum 4 $big
  # dp 2 x pp 4, interleaved over 2 chunks of 4 layers per rank, ZeRO-1, selective recompute.
  eight 8gpu-dp2-pp4-interleaved 07_full_5d.py --dp 2 --pp 4 --schedule interleaved --virtual-stages 2 --zero-stage 1 --recompute selective --grad-accum 8 $big
  # dp 8, ZeRO-3, full recompute: 16 GB of model states per rank, weights gathered per block.
  eight 8gpu-dp8-zero3 07_full_5d.py --dp 8 --zero-stage 3 --recompute full --grad-accum 1 $big
  # Each overlap against the order it replaces (issue 37): ZeRO-1's weight all-gather behind the
  # next forward, tp's async dgrad, pipeline sends left in flight; the "-waited" twin turns it off.
  eight 8gpu-dp8-zero1 07_full_5d.py --dp 8 --zero-stage 1 --recompute full --grad-accum 1 $big
  eight 8gpu-dp8-zero1-waited 07_full_5d.py --dp 8 --zero-stage 1 --recompute full --grad-accum 1 $big --no-overlap-weight-gather
  # the twin also opens one communicator per axis (time to the first step: what sharing saves)
  PICOTRON_LIKE_GROUP_PER_AXIS=1 eight 8gpu-dp2-pp2-tp2-waited 07_full_5d.py --dp 2 --pp 2 --tp 2 --sequence-parallel \
    --zero-stage 1 --recompute selective --grad-accum 4 $big --no-async-tp-dgrad --no-async-pp-sends
fi

say ""
say "failed: ${failed[*]:-none}; skipped: ${skipped[*]:-none}; $SECONDS s in all"
[ "${#failed[@]}" -eq 0 ]
