#!/usr/bin/env bash
# The GPU checks of one lease, as one script of at most 8 minutes (a lease is 15 minutes, start and
# hand-back included): what a decode step, the README's SmolLM2 step and the main command's step on
# Qwen2.5-0.5B's shapes take on this GPU, and their peak memory. Each part has its own time limit,
# so one that hangs does not cost the others; everything goes to $OUT (the device tool brings it
# back), the GPU named first.
#
#     OUT=/tmp/gpu-check bash bench/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" >> "$OUT/gpu.txt" 2>&1

# 1. the decode loop against the sampler before it (SmolLM2 and Qwen2.5-0.5B's shapes, float32
#    and bfloat16): tokens a second, a step's time, the bandwidth it reaches          (<= 150 s)
timeout 150 python bench/bench_decode.py --device cuda --repeats 2 > "$OUT/decode.txt" 2>&1

# 2. the README's SmolLM2 command, its first 6 steps (the warm start built on the GPU; the
#    diagnosis at step 1, no validation): seconds a step from its own log              (<= 120 s)
timeout 120 python train.py --env frozenlake --model smollm2 --observation coords --algo grpo \
    --lora 16 --lr 2e-4 --kl-coef 0.001 --groups 4 --group-size 4 --max-turns 2 \
    --max-new-tokens 40 --mi-samples 16 --probe-prompts 8 --probe-samples 4 --mi-every 10 \
    --val-every 0 --steps 6 --filter topp --no-plot --out "$OUT/smollm2" > "$OUT/smollm2.txt" 2>&1

# 3. the main command's step on Qwen2.5-0.5B's shapes (random weights: every turn to the limit),
#    PPO, 400 tokens a turn, within 24 GiB: time and peak memory                       (<= 180 s)
timeout 180 python bench/bench_gpu.py --size 0.5b --algo ppo --max-new-tokens 400 \
    --budget-gb 24 --out "$OUT/main" > "$OUT/main.txt" 2>&1

tail -n 3 "$OUT"/*.txt
