"""Qwen2.5-VL through llama.cpp's own converter: loom on the text GGUF and the vision
projector ``convert_hf_to_gguf.py`` writes (``--model F.gguf --mmproj mmproj-F.gguf``)
gives the greedy tokens of loom on the safetensors checkpoint they came from, for
prompts with images; and the CI test's writers (tests/model/test_mmproj.py, which need no
llama.cpp) write the converter's keys, tensor names and values.

    python benchmarks/mmproj_converter.py [--out DIR]

What it runs, in ``DIR`` (default: a temporary directory)::

    ckpt/                       the tests' tiny Qwen2.5-VL, 3 vision blocks, 112-px windows
    python convert_hf_to_gguf.py ckpt --outtype f32 --outfile gguf/tiny-f32.gguf
    python convert_hf_to_gguf.py ckpt --outtype f32 --mmproj --outfile gguf/mmproj-tiny-f32.gguf
    loom on ckpt  vs  loom on gguf/tiny-f32.gguf --mmproj gguf/mmproj-tiny-f32.gguf

The converter is run unchanged but for one thing: the tiny tokenizer (a byte-level BPE
with GPT-2's pre-tokenizer regex, trained on a few sentences) is no published model's,
so ``TextModel.get_vocab_base_pre`` recognises no hash of it and refuses
("BPE pre-tokenizer was not recognized"); the run replaces that method with one
answering ``gpt-2``, the llama.cpp name of exactly that pre-tokenizer (it only sets
``tokenizer.ggml.pre``; loom builds its tokenizer from the vocabulary and merges).
Two things of the tests' ``make_tiny_qwen2_5_vl`` the converter cannot carry, hence the
checkpoint's three vision blocks and 112-pixel windows: a two-block tower fails
(``Can not map tensor 'visual.merger.mlp.2.bias'``: gguf-py's ``TensorNameMap`` names
``merger.mlp.{bid}`` only for a block index below the depth), and the converter writes no
window size (llama.cpp and loom take 112, every published Qwen2.5-VL's). The GGUF files
sit in a directory without preprocessor_config.json: loom's image processor takes the
projector's patch size, merge size, mean and std (and llama.cpp's 8 to 4,096 rows an
image), whose pixels are checked equal to the checkpoint's processor's for these images.

llama.cpp is a benchmark tool, never a loom dependency: its source comes from
benchmarks/setup_baselines.sh (``LOOM_BENCH_ENVS``). Prints one line per check; exits 1
if any fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the CI test's writers, as pytest
sys.path.insert(0, os.path.join(ROOT, "tests", "model"))  # finds them (pythonpath)

from make_1b import LLAMA_SRC  # noqa: E402

NEW_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# the run's converter: llama.cpp's, with the tiny tokenizer's pre-tokenizer named
_CONVERT = (
    "import runpy, sys\n"
    "sys.path[:0] = [{src!r}, {src!r} + '/gguf-py']\n"
    "from conversion.base import TextModel\n"
    "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
    "sys.argv = ['convert_hf_to_gguf.py'] + sys.argv[1:]\n"
    "runpy.run_path({src!r} + '/convert_hf_to_gguf.py', run_name='__main__')\n")


def convert(checkpoint: str, outfile: str, mmproj: bool) -> str:
    command = [sys.executable, "-c", _CONVERT.format(src=LLAMA_SRC), checkpoint,
               "--outtype", "f32", "--outfile", outfile]
    subprocess.run(command + (["--mmproj"] if mmproj else []), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return outfile


def requests() -> list:
    from model.test_mmproj import image

    return [
        {"prompt": f"hello {IMAGE} the fox", "multi_modal_data": {"image": [image(112, 168, 1)]}},
        {"prompt": f"{IMAGE} and {IMAGE} compared",  # 64 rows in 4 windows, and 16
         "multi_modal_data": {"image": [image(224, 224, 2), image(112, 112, 3)]}},
        {"prompt": f"<|im_start|>user\n{IMAGE} what is it<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": [image(168, 112, 4)]}},
        "the quick brown fox jumps over the lazy dog",
    ]


def loom_tokens(model: str, **kwargs) -> list[tuple[list[int], list[int]]]:
    from loom import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=512, enable_warm_up=False, **kwargs)
    try:
        outputs = llm.generate(requests(), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True), use_tqdm=False)
        return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    finally:
        llm.shutdown()


def pixels_equal(checkpoint: str, text_gguf: str, mmproj: str) -> bool:
    """The image processor loom builds from the projector's metadata makes the
    checkpoint's processor's pixels for each request's images."""
    from loom.model.loader import load_hf_config
    from loom.multimodal.qwen_vl import image_processor

    ours = image_processor(text_gguf, load_hf_config(text_gguf, mmproj))
    theirs = image_processor(checkpoint, load_hf_config(checkpoint))
    for request in requests():
        for picture in (request["multi_modal_data"]["image"] if isinstance(request, dict) else ()):
            a, b = (p(images=[picture], return_tensors="np") for p in (ours, theirs))
            if not (np.array_equal(a["image_grid_thw"], b["image_grid_thw"])
                    and np.array_equal(a["pixel_values"], b["pixel_values"])):
                return False
    return True


def compare_with_test_writers(checkpoint: str, converted: dict[str, str], out: str) -> list[str]:
    """Differences between the converter's files and the test writers'
    (``general.name``, ``size_label``, ``quantization_version`` listed, not compared)."""
    import gguf

    from model.test_mmproj import write_mmproj, write_text_gguf

    written = {"text": write_text_gguf(checkpoint, os.path.join(out, "writer-text.gguf")),
               "mmproj": write_mmproj(checkpoint, os.path.join(out, "writer-mmproj.gguf"))}
    ignored = ("GGUF.", "general.name", "general.size_label", "general.quantization_version")
    problems = []
    for kind, path in converted.items():
        real, test = gguf.GGUFReader(path), gguf.GGUFReader(written[kind])
        real_keys = {k for k in real.fields if not k.startswith(ignored)}
        test_keys = {k for k in test.fields if not k.startswith(ignored)}
        for key in sorted(real_keys ^ test_keys):
            where = "converter" if key in real_keys else "test writer"
            problems.append(f"{kind}: only the {where} writes {key}")
        for key in sorted(real_keys & test_keys):
            a, b = real.fields[key].contents(), test.fields[key].contents()
            if a != b:
                problems.append(f"{kind}: {key}: converter {str(a)[:60]}, test writer {str(b)[:60]}")
        real_tensors = {t.name: t for t in real.tensors}
        test_tensors = {t.name: t for t in test.tensors}
        for name in sorted(set(real_tensors) ^ set(test_tensors)):
            where = "converter" if name in real_tensors else "test writer"
            problems.append(f"{kind}: tensor {name} only in the {where}'s file")
        for name in sorted(set(real_tensors) & set(test_tensors)):
            a, b = real_tensors[name], test_tensors[name]
            if a.tensor_type != b.tensor_type or not np.array_equal(np.asarray(a.data),
                                                                   np.asarray(b.data)):
                problems.append(f"{kind}: tensor {name} differs")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="keep the files here (default: a temp dir)")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py")):
        sys.exit(f"no llama.cpp converter at {LLAMA_SRC}; run benchmarks/setup_baselines.sh")
    from model.test_mmproj import make_convertible_qwen2_5_vl

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        checkpoint = make_convertible_qwen2_5_vl(os.path.join(out, "ckpt"))
        gguf_dir = os.path.join(out, "gguf")
        os.makedirs(gguf_dir, exist_ok=True)
        converted = {"text": convert(checkpoint, os.path.join(gguf_dir, "tiny-f32.gguf"), False),
                     "mmproj": convert(checkpoint, os.path.join(gguf_dir, "mmproj-tiny-f32.gguf"),
                                       True)}
        expected = loom_tokens(checkpoint)
        got = loom_tokens(converted["text"], mmproj=converted["mmproj"])
        problems = compare_with_test_writers(checkpoint, converted, out)
        checks = {
            "prompt token ids from the GGUF tokenizer equal the checkpoint's":
                [ids for ids, _ in got] == [ids for ids, _ in expected],
            "greedy tokens from the text GGUF + projector equal the checkpoint's":
                [tokens for _, tokens in got] == [tokens for _, tokens in expected],
            "the projector's image processor makes the checkpoint's pixels":
                pixels_equal(checkpoint, converted["text"], converted["mmproj"]),
            "the CI test's writers write the converter's keys and tensors": not problems,
        }
        for line in problems:
            print(f"  - {line}")
        for (_, tokens), (_, reference) in zip(got, expected):
            print(f"  gguf {tokens}  checkpoint {reference}")
        failed = False
        for check, ok in checks.items():
            print(f"{'ok  ' if ok else 'FAIL'} {check}")
            failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
