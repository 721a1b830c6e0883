"""A 1B-class random Qwen2.5-VL for the image benchmarks, as a Hugging Face directory and
llama.cpp's GGUF pair (text model and vision projector).

    python benchmarks/make_vlm.py [--out /work/bench-envs/models] [--vision-depth 32]

Text: Qwen2.5-1.5B's layer (hidden 1536, MLP 8960, 12 query and 2 KV heads of 128, q/k/v
bias, tied embeddings, rope theta 1e6) in 24 layers instead of 28, with Qwen2.5-VL's
M-RoPE (sections [16, 24, 24]); 1.14B parameters with SmolLM2's vocabulary. Vision: the
published Qwen2.5-VL tower (hidden 1280, MLP 3420, 16 heads, patches of 14, 2x2 merge,
112-pixel windows, full attention at every 8th block, SiLU), ``--vision-depth`` blocks
(32 as published), merged rows projected to the text's 1536; 0.67B parameters at 32.
Random bfloat16 weights (speed does not depend on their values).

The tokenizer is the default model's (SmolLM2: loom's conversion of its GGUF tokenizer)
with the four Qwen-VL tokens added after its 49,152 ids, and a ChatML template whose image
parts write ``<|vision_start|><|image_pad|><|vision_end|>`` (and whose other parts with
text write their text, so llama-server's media markers pass through). The image
processor is Qwen2-VL's with ``max_pixels`` 448 x 448: a 448 x 448 image is 32 x 32
patches, 256 rows after the merge, and larger images are scaled down to that.

Then llama.cpp's ``convert_hf_to_gguf.py`` (benchmarks/setup_baselines.sh unpacks it;
llama.cpp is a benchmark tool only) writes ``qwen2_5_vl-1b-random-bf16.gguf`` and, with
``--mmproj``, ``mmproj-qwen2_5_vl-1b-random-bf16.gguf`` under ``--out``. The converter
recognises SmolLM2's pre-tokenizer by its hash (``smollm``): the added tokens do not
change it, so it needs no change.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ENVS = os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs")
LLAMA_SRC = os.path.join(ENVS, "src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
NAME = "qwen2_5_vl-1b-random"

QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
IMAGE_SIDE = 448  # pixels; 448 / 14 = 32 patches a side, 16 x 16 = 256 rows after the merge


def config(vocab_size: int, token_ids: list[int], bos_id: int, eos_id: int, vision_depth: int):
    from transformers import Qwen2_5_VLConfig

    vision_start, vision_end, image_pad, video_pad = token_ids
    text_hidden = 1536
    return Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=text_hidden, intermediate_size=8960, num_hidden_layers=24,
            num_attention_heads=12, num_key_value_heads=2, vocab_size=vocab_size,
            max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
            bos_token_id=bos_id, eos_token_id=eos_id,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [16, 24, 24]}),
        vision_config=dict(
            depth=vision_depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
            out_hidden_size=text_hidden, window_size=112,
            fullatt_block_indexes=list(range(7, vision_depth, 8)), patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu",
            tokens_per_second=2),
        image_token_id=image_pad, video_token_id=video_pad,
        vision_start_token_id=vision_start, vision_end_token_id=vision_end,
        tie_word_embeddings=True, torch_dtype="bfloat16")


def make_checkpoint(path: str, vision_depth: int) -> None:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from loom.default_model import default_model_path
    from loom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path()).hf
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    token_ids = tokenizer.convert_tokens_to_ids(QWEN_VL_TOKENS)
    assert token_ids == list(range(49152, 49156)), token_ids
    tokenizer.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    hf_config = config(len(tokenizer), token_ids, tokenizer.bos_token_id,
                       tokenizer.eos_token_id, vision_depth)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2_5_VLForConditionalGeneration(hf_config)
    finally:
        torch.set_default_dtype(previous)
    text = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual"))
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual"))
    print(f"text {text / 1e9:.2f}B, vision {vision / 1e9:.2f}B parameters", flush=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56,
                             max_pixels=IMAGE_SIDE * IMAGE_SIDE).save_pretrained(path)


def convert(hf_dir: str, outfile: str, mmproj: bool) -> None:
    command = [sys.executable, os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"), hf_dir,
               "--outtype", "bf16", "--outfile", outfile]
    subprocess.run(command + (["--mmproj"] if mmproj else []), check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ENVS, "models"))
    parser.add_argument("--vision-depth", type=int, default=32,
                        help="vision blocks (32 as published; a multiple of 8)")
    args = parser.parse_args()
    hf_dir = os.path.join(args.out, NAME)
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        make_checkpoint(hf_dir, args.vision_depth)
    text_gguf = os.path.join(args.out, f"{NAME}-bf16.gguf")
    if not os.path.exists(text_gguf):
        convert(hf_dir, text_gguf, mmproj=False)
    mmproj_gguf = os.path.join(args.out, f"mmproj-{NAME}-bf16.gguf")
    if not os.path.exists(mmproj_gguf):
        convert(hf_dir, mmproj_gguf, mmproj=True)
    print(f"{hf_dir}\n{text_gguf}\n{mmproj_gguf}")


if __name__ == "__main__":
    main()
