"""ERNIE 4.5 (dense and MoE) through llama.cpp's own converter: loom loads the GGUF
file ``convert_hf_to_gguf.py`` writes (architectures ``ernie4_5`` / ``ernie4_5-moe``,
its tensor names, its SentencePiece vocabulary) and gives the Hugging Face checkpoint's
greedy tokens; and the CI tests' GGUF writer (tests/model/test_moe_gguf.py:
``write_gguf``, which needs no llama.cpp) writes the same metadata keys and tensors.

    python benchmarks/ernie_gguf_converter.py [--out DIR] [--keep]

Per family: a SentencePiece model trained here on loom's docs (a real tokenizer, which
the converter requires: ``Ernie4_5Model.set_vocab`` reads ``tokenizer.model``), a tiny
random float32 checkpoint with that vocabulary (transformers' Ernie4_5Config /
Ernie4_5_MoeConfig), the converter run on it (``--outtype f32``), then:

1. the tokenizer loom builds from the GGUF file gives the HF tokenizer's ids for each
   prompt;
2. loom's greedy tokens from the GGUF file (its config read from the metadata, weights
   under HF names, tokenizer from the file) equal transformers' float32 greedy tokens
   on the checkpoint;
3. the converter's metadata keys and tensor names, shapes and values equal those of
   the test writer's file for the same checkpoint (``general.*`` and ``tokenizer.*``
   listed, not compared: the test writer's vocabulary is placeholders).

llama.cpp is a benchmark tool, never a loom dependency: its source comes from
benchmarks/setup_baselines.sh (``LOOM_BENCH_ENVS``). Prints one line per check;
exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the CI tests' GGUF writer, as pytest
sys.path.insert(0, os.path.join(ROOT, "tests", "model"))  # finds it (pyproject: pythonpath)

from make_1b import LLAMA_SRC  # noqa: E402

PROMPTS = ["The scheduler decides which tokens of which requests run.",
           "A worker never decides; it runs the step it is given and samples.",
           "KV blocks", "Prefix caching hits blocks by their hashes"]
NEW_TOKENS = 8


def train_tokenizer(out: str, vocab_size: int) -> str:
    """A SentencePiece BPE model trained on loom's docs, as a Hugging Face tokenizer
    directory: tokenizer.model (which the converter reads) and a tokenizer_config.json
    naming LlamaTokenizer (which transformers converts from it)."""
    import sentencepiece as spm

    corpus = os.path.join(out, "corpus.txt")
    with open(corpus, "w") as f:
        for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [
                os.path.join(ROOT, "README.md")]:
            with open(path) as doc:
                f.write(doc.read())
    tokenizer_dir = os.path.join(out, "tokenizer")
    os.makedirs(tokenizer_dir, exist_ok=True)
    spm.SentencePieceTrainer.train(input=corpus,
                                   model_prefix=os.path.join(tokenizer_dir, "tokenizer"),
                                   vocab_size=vocab_size, model_type="bpe",
                                   character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, minloglevel=2)
    os.remove(os.path.join(tokenizer_dir, "tokenizer.vocab"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                   "add_eos_token": False, "legacy": False}, f)
    return tokenizer_dir


def make_checkpoint(out: str, family: str, tokenizer_dir: str, vocab_size: int) -> str:
    from transformers import AutoModelForCausalLM, Ernie4_5Config, Ernie4_5_MoeConfig

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  vocab_size=vocab_size)
    if family == "ernie4_5":
        config = Ernie4_5Config(**common, num_hidden_layers=2, use_bias=True,
                                tie_word_embeddings=True)
    else:
        config = Ernie4_5_MoeConfig(**common, num_hidden_layers=3, moe_num_experts=8, moe_k=3,
                                    moe_intermediate_size=32, moe_num_shared_experts=2,
                                    moe_layer_start_index=1, moe_layer_end_index=2,
                                    moe_layer_interval=1, tie_word_embeddings=False)
    from model.checkpoints import randomize_weights  # the tests' tiny checkpoints' draw

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model)
    path = os.path.join(out, family)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def convert(checkpoint: str) -> str:
    gguf_path = checkpoint + "-f32.gguf"
    subprocess.run([sys.executable, os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"),
                    checkpoint, "--outtype", "f32", "--outfile", gguf_path], check=True,
                   stdout=subprocess.DEVNULL)
    return gguf_path


def hf_tokens(checkpoint: str) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from e2e.test_llm_correctness import hf_greedy  # the CI tests' greedy reference

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    with torch.no_grad():
        return prompt_ids, [hf_greedy(model, ids, NEW_TOKENS) for ids in prompt_ids]


def loom_tokens(gguf_path: str) -> tuple[list[list[int]], list[list[int]]]:
    from loom import LLM, SamplingParams

    llm = LLM(gguf_path, dtype="float32", max_model_len=256, enable_warm_up=False)
    try:
        prompt_ids = [llm.get_tokenizer().encode(prompt) for prompt in PROMPTS]
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                       ignore_eos=True), use_tqdm=False)
        return prompt_ids, [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


def compare_with_test_writer(checkpoint: str, gguf_path: str, family: str) -> list[str]:
    """Differences between the converter's file and the test writer's."""
    import gguf

    from model.test_moe_gguf import write_gguf

    ours = write_gguf(checkpoint, gguf_path.replace("-f32.gguf", "-test-writer.gguf"), family)
    real, test = gguf.GGUFReader(gguf_path), gguf.GGUFReader(ours)
    ignored = ("general.", "tokenizer.", "GGUF.")
    problems = []
    real_keys = {k for k in real.fields if not k.startswith(ignored)}
    test_keys = {k for k in test.fields if not k.startswith(ignored)}
    for key in sorted(real_keys - test_keys):
        problems.append(f"the converter writes {key}, the test writer does not")
    for key in sorted(test_keys - real_keys):
        problems.append(f"the test writer writes {key}, the converter does not")
    for key in sorted(real_keys & test_keys):
        a, b = real.fields[key].contents(), test.fields[key].contents()
        if not np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float)):
            problems.append(f"{key}: converter {a}, test writer {b}")
    real_tensors = {t.name: t for t in real.tensors}
    test_tensors = {t.name: t for t in test.tensors}
    for name in sorted(set(real_tensors) ^ set(test_tensors)):
        where = "converter" if name in real_tensors else "test writer"
        problems.append(f"tensor {name} only in the {where}'s file")
    for name in sorted(set(real_tensors) & set(test_tensors)):
        a, b = np.asarray(real_tensors[name].data), np.asarray(test_tensors[name].data)
        if a.shape != b.shape or not np.array_equal(a, b):
            problems.append(f"tensor {name}: converter {a.shape}, test writer {b.shape}"
                            + ("" if a.shape != b.shape else ", values differ"))
    print(f"  keys not compared (the vocabulary's are the trained tokenizer's): "
          f"{sorted(k for k in real.fields if k.startswith(('general.', 'tokenizer.')))}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="keep the files here (default: a temp dir)")
    parser.add_argument("--vocab", type=int, default=600)
    args = parser.parse_args()
    if not os.path.exists(os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py")):
        sys.exit(f"no llama.cpp converter at {LLAMA_SRC}; run benchmarks/setup_baselines.sh")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        tokenizer_dir = train_tokenizer(out, args.vocab)
        for family in ("ernie4_5", "ernie4_5_moe"):
            checkpoint = make_checkpoint(out, family, tokenizer_dir, args.vocab)
            gguf_path = convert(checkpoint)
            hf_prompts, hf_out = hf_tokens(checkpoint)
            loom_prompts, loom_out = loom_tokens(gguf_path)
            checks = {
                "tokenizer from the GGUF file gives the HF tokenizer's ids":
                    loom_prompts == hf_prompts,
                "greedy tokens from the GGUF file equal transformers' on the checkpoint":
                    loom_out == hf_out,
            }
            print(f"{family}: {os.path.basename(gguf_path)}")
            problems = compare_with_test_writer(checkpoint, gguf_path, family)
            checks["the CI tests' writer writes the converter's keys and tensors"] = not problems
            for line in problems:
                print(f"  - {line}")
            for check, ok in checks.items():
                print(f"  {'ok  ' if ok else 'FAIL'} {check}")
                failed |= not ok
            if loom_prompts != hf_prompts:
                print(f"  loom prompt ids {loom_prompts}\n  HF prompt ids   {hf_prompts}")
            if loom_out != hf_out:
                print(f"  loom {loom_out}\n  HF   {hf_out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
