"""Two "nodes" on loopback: the engine with rank 0, `loom worker --node-rank 1` with rank 1."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from loom import LLM, SamplingParams

from .helpers import make_model_dir

ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks_override=64, dtype="float32")


def test_two_nodes_on_loopback(tmp_path):
    path = make_model_dir("qwen3", tmp_path / "qwen3")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(path, **ENGINE_ARGS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    port = random.randrange(20000, 60000)
    node_args = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "--max-model-len", "128",
                 "--num-gpu-blocks-override", "64", "--dtype", "float32"]
    remote = subprocess.Popen([sys.executable, "-m", "loom.cli", "worker", path, "--node-rank",
                               "1", *node_args])
    try:
        with LLM(path, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                 master_port=port, **ENGINE_ARGS) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected
        assert remote.wait(timeout=20) == 0  # the engine's shutdown stopped node 1
    finally:
        remote.kill()


def test_a_node_with_other_flags_fails_naming_them(tmp_path):
    """`loom worker` builds its config from its own flags: node 1 started with another
    --quantization fails start-up naming the flag, instead of holding other weights
    than rank 0 expects."""
    path = make_model_dir("qwen3", tmp_path / "qwen3")
    port = random.randrange(20000, 60000)
    node_args = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "--max-model-len", "128",
                 "--num-gpu-blocks-override", "64", "--dtype", "float32"]
    remote = subprocess.Popen([sys.executable, "-m", "loom.cli", "worker", path, "--node-rank",
                               "1", *node_args, "--quantization", "wint8"])
    try:
        with pytest.raises(Exception, match="node 1's settings differ from node 0's: "
                                            "--quantization is 'wint8' here, 'auto' on node 0"):
            LLM(path, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                master_port=port, **ENGINE_ARGS)
        assert remote.wait(timeout=20) != 0
    finally:
        remote.kill()
