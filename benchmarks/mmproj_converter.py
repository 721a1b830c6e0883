"""Qwen2.5-VL and Gemma 3 through llama.cpp's own converter: loom on the text GGUF and
the vision projector ``convert_hf_to_gguf.py`` writes (``--model F.gguf --mmproj
mmproj-F.gguf``) gives the greedy tokens of loom on the safetensors checkpoint they came
from, for prompts with images; and the CI test's writers (tests/model/test_mmproj.py,
which need no llama.cpp) write the converter's keys, tensor names and values.

    python benchmarks/mmproj_converter.py [--family qwen2_5_vl|gemma3] [--out DIR]

What it runs for each family (both unless ``--family`` names one), in ``DIR/<family>``
(default: a temporary directory)::

    ckpt/                       the tests' tiny model, made convertible (below)
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

Gemma 3 (``make_convertible_gemma3_vl``) needs more of the tests' tiny model changed,
each what a published Gemma 3 has anyway: the converter maps only the published tensor
names (``vision_tower.vision_model.*``; transformers 5 saves ``vision_tower.*``: "Can not
map tensor 'vision_tower.embeddings.patch_embedding.bias'") and no SigLIP pooling head;
it writes neither a layer pattern nor a query scale, so the text model has six layers
(llama.cpp takes every sixth global) and queries scaled by head_dim ** -0.5 (llama.cpp's,
not query_pre_attn_scalar's 256); it takes the rows an image makes from
processor_config.json's ``image_seq_length`` (absent: 256), written there as 16; and it
stores ``mm.input_projection`` as float16 whatever ``--outtype`` says, so the projection's
values are float16's for the comparison to be exact. The vocabulary is written as GPT-2's
(the tiny checkpoint has no tokenizer.model), with the same pre-tokenizer patch.

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
GEMMA3_IMAGE = "<start_of_image>"
FAMILIES = ("qwen2_5_vl", "gemma3")
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


def requests(family: str) -> list:
    from model.test_mmproj import image

    if family == "gemma3":  # every image resized to 112 x 112: 16 rows
        return [
            {"prompt": f"hello {GEMMA3_IMAGE} the fox",
             "multi_modal_data": {"image": [image(112, 168, 1)]}},
            {"prompt": f"{GEMMA3_IMAGE} and\n{GEMMA3_IMAGE} compared",
             "multi_modal_data": {"image": [image(224, 224, 2), image(112, 112, 3)]}},
            {"prompt": f"<start_of_turn>user\n{GEMMA3_IMAGE}what is it<end_of_turn>\n"
                       "<start_of_turn>model\n",
             "multi_modal_data": {"image": [image(168, 112, 4)]}},
            "the quick brown fox jumps over the lazy dog",
        ]
    return [
        {"prompt": f"hello {IMAGE} the fox", "multi_modal_data": {"image": [image(112, 168, 1)]}},
        {"prompt": f"{IMAGE} and {IMAGE} compared",  # 64 rows in 4 windows, and 16
         "multi_modal_data": {"image": [image(224, 224, 2), image(112, 112, 3)]}},
        {"prompt": f"<|im_start|>user\n{IMAGE} what is it<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": [image(168, 112, 4)]}},
        "the quick brown fox jumps over the lazy dog",
    ]


def loom_tokens(family: str, model: str, **kwargs) -> list[tuple[list[int], list[int]]]:
    from loom import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=512, enable_warm_up=False, **kwargs)
    try:
        outputs = llm.generate(requests(family), SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
        return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    finally:
        llm.shutdown()


def pixels_equal(family: str, checkpoint: str, text_gguf: str, mmproj: str) -> bool:
    """The image processor loom builds from the projector's metadata makes the
    checkpoint's processor's pixels for each request's images."""
    from loom.model.loader import load_hf_config

    if family == "gemma3":
        from loom.multimodal.gemma3 import image_processor
    else:
        from loom.multimodal.qwen_vl import image_processor

    ours = image_processor(text_gguf, load_hf_config(text_gguf, mmproj))
    theirs = image_processor(checkpoint, load_hf_config(checkpoint))
    for request in requests(family):
        for picture in (request["multi_modal_data"]["image"] if isinstance(request, dict) else ()):
            a, b = (p(images=[picture], return_tensors="np") for p in (ours, theirs))
            if not all(np.array_equal(a[key], b[key]) for key in b if key in
                       ("pixel_values", "image_grid_thw")):
                return False
    return True


def compare_with_test_writers(family: str, checkpoint: str, converted: dict[str, str],
                              out: str) -> list[str]:
    """Differences between the converter's files and the test writers'
    (``general.name``, ``size_label``, ``quantization_version`` listed, not compared)."""
    import gguf

    from model import test_mmproj

    write_text, write_mmproj = ((test_mmproj.write_gemma3_text_gguf,
                                 test_mmproj.write_gemma3_mmproj) if family == "gemma3" else
                                (test_mmproj.write_text_gguf, test_mmproj.write_mmproj))
    written = {"text": write_text(checkpoint, os.path.join(out, "writer-text.gguf")),
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


def run_family(family: str, out: str) -> bool:
    """Convert, run and compare one family in ``out``; prints its checks, True if all pass."""
    from model import test_mmproj

    make = (test_mmproj.make_convertible_gemma3_vl if family == "gemma3"
            else test_mmproj.make_convertible_qwen2_5_vl)
    checkpoint = make(os.path.join(out, "ckpt"))
    gguf_dir = os.path.join(out, "gguf")
    os.makedirs(gguf_dir, exist_ok=True)
    converted = {"text": convert(checkpoint, os.path.join(gguf_dir, "tiny-f32.gguf"), False),
                 "mmproj": convert(checkpoint, os.path.join(gguf_dir, "mmproj-tiny-f32.gguf"),
                                   True)}
    expected = loom_tokens(family, checkpoint)
    got = loom_tokens(family, converted["text"], mmproj=converted["mmproj"])
    problems = compare_with_test_writers(family, checkpoint, converted, out)
    checks = {
        "prompt token ids from the GGUF tokenizer equal the checkpoint's":
            [ids for ids, _ in got] == [ids for ids, _ in expected],
        "greedy tokens from the text GGUF + projector equal the checkpoint's":
            [tokens for _, tokens in got] == [tokens for _, tokens in expected],
        "the projector's image processor makes the checkpoint's pixels":
            pixels_equal(family, checkpoint, converted["text"], converted["mmproj"]),
        "the CI test's writers write the converter's keys and tensors": not problems,
    }
    print(family)
    for line in problems:
        print(f"  - {line}")
    for (_, tokens), (_, reference) in zip(got, expected):
        print(f"  gguf {tokens}  checkpoint {reference}")
    for check, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {family}: {check}")
    return all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default=None,
                        help="one family (default: both)")
    parser.add_argument("--out", default=None, help="keep the files here (default: a temp dir)")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py")):
        sys.exit(f"no llama.cpp converter at {LLAMA_SRC}; run benchmarks/setup_baselines.sh")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for family in [args.family] if args.family else FAMILIES:
            failed |= not run_family(family, os.path.join(args.out or tmp, family))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
