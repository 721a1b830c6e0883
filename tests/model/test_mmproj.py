"""``--mmproj``: a Qwen2.5-VL as llama.cpp's converter writes it, a ``qwen2vl`` text GGUF
and a vision projector GGUF beside it, gives the greedy tokens of the safetensors
checkpoint the two files came from, for prompts with images.

The files are written here with the ``gguf`` package (a loom dependency), mirroring the
converter (llama.cpp convert_hf_to_gguf.py, conversion/qwenvl.py): the text file as
``Qwen2VLModel`` writes it (``TextModel.set_gguf_parameters``' keys with
``rope.dimension_sections``, ``_set_vocab_gpt2``'s vocabulary through gguf-py's
``SpecialVocab``, Qwen2's tensors under ``TensorNameMap``'s names), the projector as
``Qwen2VLVisionModel`` writes it (``MmprojModel.set_gguf_parameters``' ``clip.vision.*``
keys, projector type qwen2.5vl_merger, ``n_wa_pattern``, the fused qkv split into q, k,
v, the Conv3d patch embedding split into two kernels ``v.patch_embd.weight`` and
``.weight.1``), in float32 (``--outtype f32``). The converter itself needs a llama.cpp
checkout, which CI does not have: benchmarks/mmproj_converter.py runs it on the same
checkpoint and checks that these writers write its keys, tensor names, shapes and values.

The checkpoint is the tests' tiny Qwen2.5-VL with two changes the converter forces:
three vision blocks (with two, ``TensorNameMap`` has no name for ``merger.mlp.2``: it
maps ``merger.mlp.{bid}`` only for a block index below the depth) and 112-pixel windows
(the converter writes no window size; llama.cpp, and loom, take 112).

Gemma 3 likewise: a ``gemma3`` text GGUF as ``Gemma3Model`` writes it (norms stored as
1 + w, ``rope.freq_base_swa``, ``attention.sliding_window``, the GPT-2 vocabulary of a
checkpoint without tokenizer.model) and a ``gemma3`` projector as ``Gemma3VisionModel``
writes it (the SigLIP tower under ``v.*``, ``mm.input_projection`` in float16,
``mm.soft_emb_norm`` as 1 + w, ``clip.vision.projector.scale_factor``), from the tests'
tiny Gemma 3 made convertible (``make_convertible_gemma3_vl`` says how and why).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import make_tiny_qwen2_5_vl, qwen2_5_vl_config, randomize

from loom import LLM, SamplingParams
from loom.engine_args import make_engine_config
from loom.model.loader import load_hf_config

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_NEW_TOKENS = 6


def make_convertible_qwen2_5_vl(path: str | os.PathLike) -> str:
    """``make_tiny_qwen2_5_vl`` (its tokenizer, chat template and image processor) with
    a random float32 model of three vision blocks, the second full attention, in
    112-pixel windows: what the converter can write and llama.cpp reads back."""
    path = make_tiny_qwen2_5_vl(path)
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = qwen2_5_vl_config()
    config.vision_config.depth = 3
    config.vision_config.window_size = 112
    torch.manual_seed(2525)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    randomize(model, model.model.language_model.norm)
    model.save_pretrained(path)
    return path


def _hf_config(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def write_text_gguf(checkpoint: str, path: str) -> str:
    """The language model as ``Qwen2VLModel`` writes it (arch qwen2vl), float32."""
    import gguf
    from safetensors.torch import load_file

    text = _hf_config(checkpoint)["text_config"]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2VL])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_rope_dimension_sections(text["rope_parameters"]["mrope_section"] + [0])
    writer.add_rope_freq_base(text["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_gpt2_vocabulary(writer, checkpoint, text["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, text["num_hidden_layers"])
    for name, tensor in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if name.startswith("visual."):
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.float().numpy())
    return _close(writer, path)


def _add_gpt2_vocabulary(writer, checkpoint: str, vocab_size: int) -> None:
    """``_set_vocab_gpt2``'s keys (get_vocab_base): the vocabulary by id up to the
    model's vocab_size (ids the tokenizer lacks as unused "[PAD<id>]"), added special
    tokens as CONTROL; the pre-tokenizer is the tiny tokenizer's GPT-2 regex
    (benchmarks/mmproj_converter.py)."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    ids = range(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([by_id.get(i, f"[PAD{i}]") for i in ids])
    writer.add_token_types([gguf.TokenType.UNUSED if i not in by_id else
                            gguf.TokenType.CONTROL if i in added and added[i].special else
                            gguf.TokenType.NORMAL for i in ids])
    gguf.SpecialVocab(checkpoint, load_merges=True).add_to_gguf(writer)


def write_mmproj(checkpoint: str, path: str) -> str:
    """The vision tower as ``Qwen2VLVisionModel`` writes it (``--mmproj``), float32."""
    import gguf
    from safetensors.torch import load_file

    config = _hf_config(checkpoint)
    vision = config["vision_config"]
    with open(os.path.join(checkpoint, "preprocessor_config.json")) as f:
        preprocessor = json.load(f)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision.get("image_size", 560))
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(vision["fullatt_block_indexes"][0] + 1)
    # the top level's rms_norm_eps, which a transformers 5 config keeps in text_config
    writer.add_vision_attention_layernorm_eps(config.get("rms_norm_eps", 1e-6))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])
    patch_embed = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
    for name, tensor in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if not name.startswith("visual."):
            continue
        tensor = tensor.float()
        if ".qkv." in name:  # rows | q | k | v |
            parts = zip(("q", "k", "v"), tensor.chunk(3, dim=0))
        elif name == "visual.patch_embed.proj.weight":  # Conv3d -> two Conv2d kernels
            writer.add_tensor(patch_embed, tensor[:, :, 0].numpy())
            writer.add_tensor(patch_embed + ".1", tensor[:, :, 1].numpy())
            continue
        else:
            parts = [(None, tensor)]
        for part, values in parts:
            part_name = name if part is None else name.replace("qkv", part)
            gguf_name = names.get_name(part_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, part_name
            writer.add_tensor(gguf_name, values.contiguous().numpy())
    return _close(writer, path)


def _close(writer, path: str) -> str:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str, str]:
    """(checkpoint directory, text GGUF, projector GGUF); the GGUF files in a directory
    of their own, without the checkpoint's preprocessor_config.json."""
    checkpoint = make_convertible_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))
    out = tmp_path_factory.mktemp("gguf")
    return (checkpoint, write_text_gguf(checkpoint, str(out / "tiny-f32.gguf")),
            write_mmproj(checkpoint, str(out / "mmproj-tiny-f32.gguf")))


def greedy(model: str, requests: list, **kwargs) -> list[tuple[list[int], list[int]]]:
    """(prompt token ids, greedy tokens) of each request."""
    llm = LLM(model, dtype="float32", max_model_len=256, seed=0, enable_warm_up=False,
              **kwargs)
    try:
        outputs = llm.generate(requests, SamplingParams(temperature=0.0,
                                                        max_tokens=MAX_NEW_TOKENS,
                                                        ignore_eos=True), use_tqdm=False)
        return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    finally:
        llm.shutdown()


def test_config_from_the_two_files(files):
    checkpoint, text, mmproj = files
    expected, got = load_hf_config(checkpoint), load_hf_config(text, mmproj)
    assert got.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                 "vision_end_token_id", "num_hidden_layers", "vocab_size", "hidden_size",
                 "tie_word_embeddings"):
        assert getattr(got, name) == getattr(expected, name), name
    assert got.rope_parameters["mrope_section"] == expected.rope_parameters["mrope_section"]
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                 "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                 "fullatt_block_indexes", "hidden_act"):
        assert getattr(got.vision_config, name) == getattr(expected.vision_config, name), name
    # alone, the text file is Qwen2's language model
    assert load_hf_config(text).architectures == ["Qwen2ForCausalLM"]


def test_greedy_tokens_equal_the_checkpoints(files):
    """A prompt with one image of 24 rows in two 112-pixel windows, twice with two
    images (the image processor's settings from the projector's metadata: no
    preprocessor_config.json beside the files)."""
    checkpoint, text, mmproj = files
    requests = [{"prompt": f"hello {IMAGE} the fox",
                 "multi_modal_data": {"image": [image(112, 168, seed)]}} for seed in (1, 3)]
    expected = greedy(checkpoint, requests)
    got = greedy(text, requests, mmproj=mmproj)
    assert got == expected
    assert expected[0][0].count(258) == 24  # the image's rows were in the prompt
    assert expected[0][1] != expected[1][1]  # and the tower's rows decide the tokens


def test_bad_mmproj_is_one_line_naming_the_flag(files, tmp_path):
    import gguf

    checkpoint, text, mmproj = files
    other, gemma3 = str(tmp_path / "mmproj-other.gguf"), str(tmp_path / "mmproj-gemma3.gguf")
    for projector, kind in ((other, gguf.VisionProjectorType.IDEFICS3),
                            (gemma3, gguf.VisionProjectorType.GEMMA3)):
        writer = gguf.GGUFWriter(projector, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
        writer.add_clip_projector_type(kind)
        _close(writer, projector)
    llama = str(tmp_path / "llama.gguf")
    writer = gguf.GGUFWriter(llama, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    for add in (writer.add_block_count, writer.add_head_count, writer.add_head_count_kv):
        add(2)
    writer.add_embedding_length(64)
    _close(writer, llama)
    cases = {
        (checkpoint, mmproj): "--mmproj goes with a .gguf text model",
        (text, str(tmp_path / "missing.gguf")): "does not exist",
        (text, other): "is a idefics3 projector",
        (text, gemma3): "is Gemma 3's projector but tiny-f32.gguf is a qwen2vl model",
        (text, text): "is a qwen2vl model, not a vision projector",
        (text, os.path.join(checkpoint, "config.json")): "is not a GGUF file",
        (llama, mmproj): "is a llama model, not Qwen2.5-VL's",
    }
    for (model, projector), message in cases.items():
        with pytest.raises(ValueError, match=message) as error:
            make_engine_config(model, mmproj=projector)
        assert "--mmproj" in str(error.value) and "\n" not in str(error.value)


# ---- Gemma 3: a gemma3 text GGUF and a gemma3 projector ----------------------------------

GEMMA3_IMAGE = "<start_of_image>"


def make_convertible_gemma3_vl(path: str | os.PathLike) -> str:
    """``make_tiny_gemma3_vl`` (its tokenizer, chat template and image processor) with a
    random float32 model the converter can write and llama.cpp reads as Hugging Face
    does: six text layers (llama.cpp takes every sixth layer global, as every Gemma 3;
    the converter writes no layer pattern), queries scaled by head_dim ** -0.5 (llama.cpp
    scales by it, not by query_pre_attn_scalar, which every Gemma 3 but the 27B sets to
    head_dim), no SigLIP pooling head (Gemma 3's config has none), the tower saved under
    the published names (``vision_tower.vision_model.``: the converter maps no other),
    the image's 16 rows in processor_config.json (``image_seq_length``, whence the
    converter's pool), and the projection's values float16's (the converter stores it
    as float16 whatever --outtype says)."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3ForConditionalGeneration
    from vlm_checkpoints import gemma3_vl_config, make_tiny_gemma3_vl

    path = make_tiny_gemma3_vl(path)
    config = gemma3_vl_config()
    config.text_config.num_hidden_layers = 6
    config.text_config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config.text_config.query_pre_attn_scalar = config.text_config.head_dim
    config.vision_config.vision_use_head = False
    torch.manual_seed(3303)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    randomize(model, model.model.language_model.norm)
    with torch.no_grad():  # SigLIP's LayerNorms near one too, so its layers count
        for name, param in model.model.vision_tower.named_parameters():
            if name.endswith(("layer_norm1.weight", "layer_norm2.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_(projection.half().float())
    model.save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    tensors = {("vision_tower.vision_model." + name[len("vision_tower."):]
                if name.startswith("vision_tower.") else name): tensor
               for name, tensor in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_seq_length": config.mm_tokens_per_image,
                   "processor_class": "Gemma3Processor"}, f)
    return path


def write_gemma3_text_gguf(checkpoint: str, path: str) -> str:
    """The language model as ``Gemma3Model`` writes it (arch gemma3), float32: norms
    stored as 1 + w, the vocabulary as ``_set_vocab_gpt2`` writes it (no tokenizer.model)."""
    import gguf
    from safetensors.torch import load_file

    text = _hf_config(checkpoint)["text_config"]
    rope = text["rope_parameters"]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA3])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_sliding_window(text["sliding_window"])
    _add_gpt2_vocabulary(writer, checkpoint, text["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, text["num_hidden_layers"])
    for name, tensor in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if not name.startswith("language_model."):
            continue
        name = name[len("language_model."):]
        tensor = tensor.float() + (1.0 if name.endswith("norm.weight") else 0.0)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                          tensor.numpy())
    return _close(writer, path)


def write_gemma3_mmproj(checkpoint: str, path: str) -> str:
    """The vision tower and projector as ``Gemma3VisionModel`` writes them (``--mmproj``,
    float32 but the projection's float16), the soft embedding norm stored as 1 + w."""
    import gguf
    from safetensors.torch import load_file

    config = _hf_config(checkpoint)
    vision = config["vision_config"]
    with open(os.path.join(checkpoint, "preprocessor_config.json")) as f:
        preprocessor = json.load(f)
    with open(os.path.join(checkpoint, "processor_config.json")) as f:
        rows = json.load(f)["image_seq_length"]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    scale = (vision["image_size"] // vision["patch_size"]) // int(rows ** 0.5)
    if scale != 4:  # the converter writes it where it is not llama.cpp's default
        writer.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        name = name.replace("_weight", ".weight")
        tensor = tensor.float() + (1.0 if "soft_emb_norm.weight" in name else 0.0)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.half().numpy() if "input_projection" in name
                          else tensor.numpy())
    return _close(writer, path)


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory) -> tuple[str, str, str]:
    """(checkpoint directory, text GGUF, projector GGUF), the GGUF files without the
    checkpoint's preprocessor_config.json beside them."""
    checkpoint = make_convertible_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"))
    out = tmp_path_factory.mktemp("gemma3_gguf")
    return (checkpoint, write_gemma3_text_gguf(checkpoint, str(out / "tiny-f32.gguf")),
            write_gemma3_mmproj(checkpoint, str(out / "mmproj-tiny-f32.gguf")))


def test_gemma3_config_and_greedy_tokens_equal_the_checkpoints(gemma3_files):
    """The config the two files make is the checkpoint's, and a prompt with one image
    (its 16 rows pooled from 8 x 8 patches, resized from 112 x 168 by the projector's
    settings) gives the checkpoint's prompt ids and greedy tokens, for two images."""
    checkpoint, text, mmproj = gemma3_files
    expected, got = load_hf_config(checkpoint), load_hf_config(text, mmproj)
    assert got.architectures == ["Gemma3ForConditionalGeneration"]
    for name in ("boi_token_id", "image_token_id", "eoi_token_id", "mm_tokens_per_image",
                 "num_hidden_layers", "vocab_size", "hidden_size", "head_dim",
                 "layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters",
                 "final_logit_softcapping", "tie_word_embeddings"):
        assert getattr(got, name) == getattr(expected, name), name
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "image_size", "patch_size", "layer_norm_eps",
                 "hidden_act", "num_channels"):
        assert getattr(got.vision_config, name) == getattr(expected.vision_config, name), name
    # alone, the text file is Gemma 3's language model
    assert load_hf_config(text).architectures == ["Gemma3ForCausalLM"]
    requests = [{"prompt": f"hello {GEMMA3_IMAGE} the fox",
                 "multi_modal_data": {"image": [image(112, 168, seed)]}} for seed in (1, 3)]
    expected_tokens = greedy(checkpoint, requests)
    assert greedy(text, requests, mmproj=mmproj) == expected_tokens
    assert expected_tokens[0][0].count(257) == 16  # the image's rows were in the prompt
    assert expected_tokens[0][1] != expected_tokens[1][1]  # and the tower's rows decide


def test_gemma3_feed_forward_named_by_its_rows():
    """An older converter's projector names SigLIP's fc1 ``ffn_down`` and fc2 ``ffn_up``;
    the rows say which is which (as llama.cpp's clip.cpp swaps them back)."""
    from loom.model.loader.gguf_mmproj import gemma3_tensor_target

    metadata = {"clip.vision.feed_forward_length": 64, "clip.vision.embedding_length": 32}
    layer = "vision_tower.vision_model.encoder.layers.1.mlp"
    for name, shape, expected in (("v.blk.1.ffn_up.weight", (64, 32), "fc1.weight"),
                                  ("v.blk.1.ffn_down.bias", (32,), "fc2.bias"),
                                  ("v.blk.1.ffn_down.weight", (64, 32), "fc1.weight"),
                                  ("v.blk.1.ffn_up.bias", (32,), "fc2.bias")):
        assert gemma3_tensor_target(name, shape, metadata) == (f"{layer}.{expected}", 0.0)
    assert gemma3_tensor_target("mm.soft_emb_norm.weight", (32,), metadata) == \
        ("multi_modal_projector.mm_soft_emb_norm.weight", 1.0)


def test_gemma3_text_config_as_llama_cpp_reads_it():
    """What the published Gemma 3 files carry beyond the tiny one: the global layers'
    linear rope scaling (4B and up), the 62-layer 27B's queries scaled by hidden / heads,
    a layer pattern as one flag a layer, no sliding window (every layer global)."""
    from loom.model.loader.gguf_configs import _gemma3_fields

    sizes = dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32,
                 head_dim=128)
    fields = _gemma3_fields({"gemma3.attention.sliding_window": 1024,
                             "gemma3.rope.scaling.type": "linear",
                             "gemma3.rope.scaling.factor": 8.0}, sizes)
    assert fields["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert fields["query_pre_attn_scalar"] == 168
    assert fields["layer_types"][4:7] == ["sliding_attention", "full_attention",
                                          "sliding_attention"]
    sizes |= dict(num_hidden_layers=3, head_dim=256)
    flags = {"gemma3.attention.sliding_window": 512,
             "gemma3.attention.sliding_window_pattern": [True, False, True]}
    assert _gemma3_fields(flags, sizes)["layer_types"] == [
        "sliding_attention", "full_attention", "sliding_attention"]
    assert _gemma3_fields(flags, sizes)["query_pre_attn_scalar"] == 256
    assert _gemma3_fields({}, sizes)["layer_types"] == ["full_attention"] * 3
