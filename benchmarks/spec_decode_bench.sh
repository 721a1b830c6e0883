#!/usr/bin/env bash
# N-gram speculative decoding measured with `loom bench` on the `repeat` dataset (copy a
# code passage: drafts help), without and with speculation, interleaved, ROUNDS times;
# default model (SmolLM2-135M-Instruct GGUF, bfloat16): `loom bench latency` at batch 1
# and 4, `loom bench throughput` at 4 concurrent sequences, then `loom bench serve`
# (chat endpoint, concurrency 1 and 4) against `loom serve` on $PORT. JSON results in
# $OUT; the table from benchmarks/spec_decode_summary.py (medians over the rounds).
#   benchmarks/spec_decode_bench.sh [ROUNDS] [OUT]      # ROUNDS default 3
# Results already in $OUT are kept: a larger ROUNDS adds rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
OUT=${2:-benchmarks/results/spec_decode}
PORT=${PORT:-8131}
SPEC='{"method": "ngram", "num_speculative_tokens": 4}'
mkdir -p "$OUT"
spec_args() { [ "$1" = ngram ] && echo --speculative-config && echo "$SPEC"; return 0; }

for round in $(seq 1 "$ROUNDS"); do
  for mode in none ngram; do
    mapfile -t spec < <(spec_args "$mode")
    [ -e "$OUT/latency-$mode-$round.json" ] || loom bench latency --dataset-name repeat \
      --input-len 256 --output-len 128 --batch-size 1 4 --num-iters 1 --num-iters-warmup 1 \
      "${spec[@]}" --label "$mode" --result-file "$OUT/latency-$mode-$round.json"
    [ -e "$OUT/throughput-$mode-$round.json" ] || loom bench throughput --dataset-name repeat \
      --num-prompts 8 --input-len 256 --output-len 128 --max-num-seqs 4 --disable-tqdm \
      "${spec[@]}" --label "$mode" --result-file "$OUT/throughput-$mode-$round.json"
  done
done

for round in $(seq 1 "$ROUNDS"); do
  for mode in ngram none; do
    [ -e "$OUT/serve-$mode-$round-c4.json" ] && continue
    mapfile -t spec < <(spec_args "$mode")
    loom serve --port "$PORT" --disable-log-requests "${spec[@]}" > "$OUT/server.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
      sleep 1
    done
    for concurrency in 1 4; do
      loom bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions \
        --dataset-name repeat --tokenizer default --num-prompts 8 --random-input-len 256 \
        --random-output-len 128 --max-concurrency "$concurrency" --disable-tqdm \
        --label "$mode" --result-file "$OUT/serve-$mode-$round-c$concurrency.json"
    done
    kill "$server"
    wait "$server" || true
  done
done
python benchmarks/spec_decode_summary.py "$OUT"
