"""A llama.cpp vision projector beside a GGUF text model (``--mmproj FILE``): the
multimodal config the two files make together, the image processor's settings, and
the names the projector's tensors had in the checkpoint.

llama.cpp's converter writes a Qwen2.5-VL as two files (convert_hf_to_gguf.py;
conversion/qwenvl.py): the language model as a ``qwen2vl`` text GGUF
(``Qwen2VLModel``: Qwen2's tensors, ``rope.dimension_sections`` the M-RoPE sections
padded to four), and, with ``--mmproj``, the vision tower as its own file
(``Qwen2VLVisionModel``, an ``MmprojModel``: ``general.architecture`` clip,
``clip.projector_type`` qwen2.5vl_merger). The tower's config, from the projector::

    clip.vision.block_count                 depth
    clip.vision.embedding_length            hidden_size
    clip.vision.feed_forward_length         intermediate_size
    clip.vision.attention.head_count        num_heads
    clip.vision.projection_dim              out_hidden_size (the text model's hidden size)
    clip.vision.patch_size                  patch_size
    clip.vision.spatial_merge_size          spatial_merge_size; absent: 2 (llama.cpp's)
    clip.vision.n_wa_pattern = p            fullatt_block_indexes p-1, 2p-1, ... (the
                                            converter's p is the first index + 1)
    clip.vision.window_size                 window_size; absent: 112 (llama.cpp's: the
                                            converter does not write it, and every
                                            published Qwen2.5-VL has 112)

and its tensors, back to the checkpoint's names (``visual.`` prefix)::

    v.patch_embd.weight, v.patch_embd.weight.1   patch_embed.proj.weight: the Conv3d's
                                                 two temporal kernels, which the converter
                                                 split into two Conv2d (E, C, P, P),
                                                 stacked back on axis 2
    v.blk.N.attn_{q,k,v}.{weight,bias}      blocks.N.attn.qkv: the fused rows | q | k | v |
                                            the converter split, concatenated back
    v.blk.N.attn_out                        blocks.N.attn.proj
    v.blk.N.ffn_{gate,up,down}              blocks.N.mlp.{gate,up,down}_proj
    v.blk.N.ln1, ln2                        blocks.N.norm1, norm2
    v.post_ln                               merger.ln_q
    mm.0, mm.2                              merger.mlp.0, merger.mlp.2

The image, video and vision start/end token ids are the text file's vocabulary's ids
of ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>``. What
neither file says is Hugging Face's fixed choice: the tower's norms' epsilon 1e-6 (the
projector's ``layer_norm_epsilon`` is the text config's, which transformers' tower does
not read either), two frames a temporal patch, 2 video tokens per second.

The image processor is the checkpoint's ``Qwen2VLImageProcessor`` with the projector's
patch size, merge size, mean and std; its pixel bounds are ``clip.vision.image_min_pixels``
and ``image_max_pixels`` where the file has them, else llama.cpp's for this projector
(8 to 4,096 merged rows an image; the published checkpoints' preprocessor_config.json
allows 4 to 16,384: put it beside the .gguf file to use it instead).

Gemma 3 (``Gemma3VisionModel`` in conversion/gemma.py, projector type ``gemma3``) beside
a ``gemma3`` text GGUF (read as llama.cpp reads it: gguf_configs.py) makes a
``Gemma3Config``; from the projector::

    clip.vision.block_count, embedding_length, feed_forward_length, attention.head_count,
    image_size, patch_size, attention.layer_norm_epsilon    the SigLIP tower's sizes
    clip.vision.projector.scale_factor = k      the projector's average pool, k x k patches
                                                a row (absent: 4, llama.cpp's, every
                                                published Gemma 3's): mm_tokens_per_image
                                                (image_size / patch_size / k) ** 2
    clip.vision.projection_dim                  the text model's hidden size

and its tensors, back to the published checkpoints' names (``vision_tower.vision_model.``
and ``multi_modal_projector.``)::

    v.patch_embd, v.position_embd           embeddings.patch_embedding (the conv kernel
                                            as it was), .position_embedding
    v.blk.N.attn_{q,k,v,out}                encoder.layers.N.self_attn.{q,k,v,out}_proj
    v.blk.N.ln1, ln2                        encoder.layers.N.layer_norm1, layer_norm2
    v.blk.N.ffn_up, ffn_down                encoder.layers.N.mlp.fc1, fc2; a file whose
                                            "down" makes the feed-forward width is an older
                                            converter's, with the two swapped (llama.cpp's
                                            clip.cpp swaps them back, and so does loom)
    v.post_ln                               post_layernorm
    mm.input_projection.weight              mm_input_projection_weight (D, text hidden) as
                                            the checkpoint keeps it; the converter stores it
                                            as float16 whatever --outtype says
    mm.soft_emb_norm.weight                 mm_soft_emb_norm.weight, less the 1 the
                                            converter added (the model adds it again)

The image, start and end token ids are the text file's vocabulary's ids of
``<image_soft_token>``, ``<start_of_image>``, ``<end_of_image>`` (the converter copies
every token's text; llama.cpp itself writes the start and end markers as text around an
image's rows). What neither file says is Hugging Face's fixed choice: SigLIP's GELU
(tanh), three channels, no pooling head. The image processor is ``Gemma3ImageProcessor``
with the projector's image size, mean and std and bilinear resampling (llama.cpp's and the
published preprocessor_config.json's), no pan-and-scan.

Nothing here imports torch: the API process builds the config and the processor.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from loom.model.loader.gguf_file import GGUFFile

PROJECTOR_TYPE = "qwen2.5vl_merger"  # Qwen2.5-VL's (Gemma 3's below)
TEXT_ARCHITECTURE = "qwen2vl"  # the text GGUF beside it
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
PATCH_EMBED = "visual.patch_embed.proj.weight"
# llama.cpp's values for what the converter does not write (tools/mtmd/clip.cpp)
_DEFAULT_MERGE = 2
_DEFAULT_WINDOW_SIZE = 112
_DEFAULT_IMAGE_ROWS = (8, 4096)
_TOKENS_PER_SECOND = 2
# config field -> the vocabulary's token
_VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                  "vision_start_token_id": "<|vision_start|>",
                  "vision_end_token_id": "<|vision_end|>"}
# projector tensor (without .weight/.bias) -> (checkpoint module, part, parts)
_BLOCK_PARTS = {"attn_q": ("attn.qkv", 0, 3), "attn_k": ("attn.qkv", 1, 3),
                "attn_v": ("attn.qkv", 2, 3), "attn_out": ("attn.proj", 0, 1),
                "ffn_gate": ("mlp.gate_proj", 0, 1), "ffn_up": ("mlp.up_proj", 0, 1),
                "ffn_down": ("mlp.down_proj", 0, 1), "ln1": ("norm1", 0, 1),
                "ln2": ("norm2", 0, 1)}
_GLOBAL_PARTS = {"v.post_ln.weight": ("visual.merger.ln_q.weight", 0, 1),
                 "mm.0.weight": ("visual.merger.mlp.0.weight", 0, 1),
                 "mm.0.bias": ("visual.merger.mlp.0.bias", 0, 1),
                 "mm.2.weight": ("visual.merger.mlp.2.weight", 0, 1),
                 "mm.2.bias": ("visual.merger.mlp.2.bias", 0, 1),
                 "v.patch_embd.weight": (PATCH_EMBED, 0, 2),
                 "v.patch_embd.weight.1": (PATCH_EMBED, 1, 2)}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")

GEMMA3_PROJECTOR = "gemma3"
GEMMA3_ARCHITECTURE = "Gemma3ForConditionalGeneration"
# projector type -> the text GGUF's architecture beside it
_TEXT_ARCHITECTURES = {PROJECTOR_TYPE: TEXT_ARCHITECTURE, GEMMA3_PROJECTOR: "gemma3"}
_GEMMA3_SCALE_FACTOR = 4  # llama.cpp's pool where the projector names none
_GEMMA3_TOKENS = {"boi_token_index": "<start_of_image>",
                  "image_token_index": "<image_soft_token>",
                  "eoi_token_index": "<end_of_image>"}
_GEMMA3_TOWER = "vision_tower.vision_model."
_GEMMA3_GLOBAL_NAMES = {
    "v.patch_embd": _GEMMA3_TOWER + "embeddings.patch_embedding",
    "v.position_embd": _GEMMA3_TOWER + "embeddings.position_embedding",
    "v.post_ln": _GEMMA3_TOWER + "post_layernorm",
    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
}
_GEMMA3_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                       "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
                       "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
                       "ffn_down": "mlp.fc2"}
_GEMMA3_PROJECTION = ("mm.input_projection.weight",
                      "multi_modal_projector.mm_input_projection_weight")
_GEMMA3_NORM_OFFSET = "mm.soft_emb_norm.weight"  # stored as 1 + w
_PIL_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR


def mmproj_tensor_target(name: str) -> tuple[str, int, int]:
    """``v.blk.3.attn_k.bias`` -> (``visual.blocks.3.attn.qkv.bias``, 1, 3): the
    checkpoint tensor a projector tensor is part of, which part, and of how many (the
    parts of the patch embedding are stacked on axis 2, the others concatenated)."""
    if name in _GLOBAL_PARTS:
        return _GLOBAL_PARTS[name]
    if (m := _BLOCK_RE.match(name)) and m.group(2) in _BLOCK_PARTS:
        module, part, parts = _BLOCK_PARTS[m.group(2)]
        return f"visual.blocks.{m.group(1)}.{module}.{m.group(3)}", part, parts
    raise ValueError(f"--mmproj: the projector's tensor {name!r} is no part of Qwen2.5-VL's "
                     f"vision tower; convert the projector again from the Qwen2.5-VL "
                     f"checkpoint (convert_hf_to_gguf.py --mmproj)")


def open_mmproj(model: str, mmproj: str) -> GGUFFile:
    """The projector file given with ``--mmproj`` beside ``model``, checked: a .gguf text
    model, an existing GGUF file, a projector loom loads."""
    if not (os.path.isfile(model) and model.endswith(".gguf")):
        raise ValueError(f"--mmproj goes with a .gguf text model, and {model} is not one; "
                         f"drop --mmproj (a checkpoint directory's config.json names its "
                         f"vision tower itself) or give the text model's .gguf file")
    if not os.path.isfile(mmproj):
        raise ValueError(f"--mmproj {mmproj} does not exist; give the mmproj-*.gguf file "
                         f"llama.cpp's converter wrote beside {os.path.basename(model)}")
    with open(mmproj, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"--mmproj {mmproj} is not a GGUF file; give the mmproj-*.gguf "
                             f"file llama.cpp's converter wrote beside {os.path.basename(model)}")
    try:
        projector = GGUFFile(mmproj)
    except ValueError as error:  # truncated or corrupt: the message says what to do
        raise ValueError(f"--mmproj: {error}") from None
    architecture = projector.metadata.get("general.architecture")
    kind = projector.metadata.get("clip.projector_type")
    if architecture != "clip":
        raise ValueError(f"--mmproj {mmproj} is a {architecture} model, not a vision projector "
                         f"(general.architecture clip); give the mmproj-*.gguf file beside "
                         f"the text model")
    if kind not in _TEXT_ARCHITECTURES:
        raise ValueError(f"--mmproj {mmproj} is a {kind} projector; loom loads Qwen2.5-VL's "
                         f"({PROJECTOR_TYPE}) and Gemma 3's ({GEMMA3_PROJECTOR}): give the "
                         f"projector converted from the same checkpoint as "
                         f"{os.path.basename(model)}")
    return projector


def multimodal_config(text_config: Any, text_file: GGUFFile, projector: GGUFFile) -> Any:
    """The ``Qwen2_5_VLConfig`` of a ``qwen2vl`` text GGUF (``text_config``, read from
    ``text_file``) and its projector (:func:`open_mmproj`), or a Gemma 3 projector's
    ``Gemma3Config`` (:func:`gemma3_config`); ``config.mmproj`` names the projector file,
    where the model loader reads the tower's weights."""
    if projector.metadata.get("clip.projector_type") == GEMMA3_PROJECTOR:
        return gemma3_config(text_config, text_file, projector)
    from transformers import Qwen2_5_VLConfig

    mmproj = projector.path
    metadata = projector.metadata
    name = os.path.basename(text_file.path)
    architecture = text_file.metadata.get("general.architecture")
    if architecture != TEXT_ARCHITECTURE:
        raise ValueError(f"--mmproj {mmproj} is Qwen2.5-VL's projector but {name} is a "
                         f"{architecture} model, not Qwen2.5-VL's ({TEXT_ARCHITECTURE}); give "
                         f"the text GGUF converted from the same checkpoint")
    projection = int(metadata["clip.vision.projection_dim"])
    if projection != text_config.hidden_size:
        raise ValueError(f"--mmproj {mmproj} makes rows of {projection} but {name}'s hidden "
                         f"size is {text_config.hidden_size}: the files are not from one "
                         f"checkpoint; give the projector converted with this text model")
    vocabulary = text_file.metadata.get("tokenizer.ggml.tokens") or []
    token_ids = {token: i for i, token in enumerate(vocabulary) if token in
                 _VISION_TOKENS.values()}
    lacking = [token for token in _VISION_TOKENS.values() if token not in token_ids]
    if lacking:
        raise ValueError(f"{name}'s vocabulary has no {', '.join(lacking)}: it is not "
                         f"Qwen2.5-VL's; give the text GGUF converted with the projector")
    if "v.patch_embd.weight.1" not in projector.tensors:
        raise ValueError(f"--mmproj {mmproj} has one patch kernel (v.patch_embd.weight); "
                         f"Qwen2.5-VL's has two, one per frame of a temporal patch")
    depth = int(metadata["clip.vision.block_count"])
    pattern = int(metadata.get("clip.vision.n_wa_pattern", 0))  # 0: every block full
    sections = [int(size) for size in
                text_file.metadata.get(f"{TEXT_ARCHITECTURE}.rope.dimension_sections", ())][:3]
    rope = dict(text_config.rope_parameters) | {"mrope_section": sections}
    text_fields = ("hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "vocab_size",
                   "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                   "eos_token_id", "pad_token_id")
    config = Qwen2_5_VLConfig(
        architectures=[ARCHITECTURE],
        text_config={field: getattr(text_config, field) for field in text_fields}
        | {"rope_parameters": rope},
        vision_config=dict(
            depth=depth,
            hidden_size=int(metadata["clip.vision.embedding_length"]),
            intermediate_size=int(metadata["clip.vision.feed_forward_length"]),
            num_heads=int(metadata["clip.vision.attention.head_count"]),
            out_hidden_size=projection,
            patch_size=int(metadata["clip.vision.patch_size"]),
            spatial_merge_size=int(metadata.get("clip.vision.spatial_merge_size",
                                                _DEFAULT_MERGE)),
            temporal_patch_size=2,
            window_size=int(metadata.get("clip.vision.window_size", _DEFAULT_WINDOW_SIZE)),
            fullatt_block_indexes=[i for i in range(depth)
                                   if not pattern or (i + 1) % pattern == 0],
            hidden_act="silu", tokens_per_second=_TOKENS_PER_SECOND),
        tie_word_embeddings=text_config.tie_word_embeddings,
        **{field: token_ids[token] for field, token in _VISION_TOKENS.items()})
    config._name_or_path = text_config._name_or_path
    config.mmproj = os.path.abspath(mmproj)
    return config


def image_processor_kwargs(mmproj: str) -> dict[str, Any]:
    """The image processor's settings from the projector's metadata:
    ``Qwen2VLImageProcessor``'s, or for a Gemma 3 projector ``Gemma3ImageProcessor``'s."""
    metadata = GGUFFile(mmproj).metadata
    if metadata.get("clip.projector_type") == GEMMA3_PROJECTOR:
        size = int(metadata["clip.vision.image_size"])
        return dict(size={"height": size, "width": size}, resample=_PIL_BILINEAR,
                    image_mean=[float(v) for v in metadata["clip.vision.image_mean"]],
                    image_std=[float(v) for v in metadata["clip.vision.image_std"]],
                    do_pan_and_scan=False)
    patch = int(metadata["clip.vision.patch_size"])
    merge = int(metadata.get("clip.vision.spatial_merge_size", _DEFAULT_MERGE))
    row_pixels = (patch * merge) ** 2  # one merged row's
    min_rows, max_rows = _DEFAULT_IMAGE_ROWS
    return dict(
        patch_size=patch, merge_size=merge, temporal_patch_size=2,
        image_mean=[float(v) for v in metadata["clip.vision.image_mean"]],
        image_std=[float(v) for v in metadata["clip.vision.image_std"]],
        size={"shortest_edge": int(metadata.get("clip.vision.image_min_pixels",
                                                min_rows * row_pixels)),
              "longest_edge": int(metadata.get("clip.vision.image_max_pixels",
                                               max_rows * row_pixels))})


def gemma3_config(text_config: Any, text_file: GGUFFile, projector: GGUFFile) -> Any:
    """The ``Gemma3Config`` of a ``gemma3`` text GGUF (``text_config``, read from
    ``text_file``) and its ``gemma3`` projector; ``config.mmproj`` names the projector."""
    from transformers import Gemma3Config

    mmproj = projector.path
    metadata = projector.metadata
    name = os.path.basename(text_file.path)
    architecture = text_file.metadata.get("general.architecture")
    if architecture != _TEXT_ARCHITECTURES[GEMMA3_PROJECTOR]:
        raise ValueError(f"--mmproj {mmproj} is Gemma 3's projector but {name} is a "
                         f"{architecture} model, not Gemma 3's (gemma3); give the text GGUF "
                         f"converted from the same checkpoint")
    projection = int(metadata["clip.vision.projection_dim"])
    if projection != text_config.hidden_size:
        raise ValueError(f"--mmproj {mmproj} makes rows of {projection} but {name}'s hidden "
                         f"size is {text_config.hidden_size}: the files are not from one "
                         f"checkpoint; give the projector converted with this text model")
    vocabulary = text_file.metadata.get("tokenizer.ggml.tokens") or []
    token_ids = {token: i for i, token in enumerate(vocabulary)
                 if token in _GEMMA3_TOKENS.values()}
    lacking = [token for token in _GEMMA3_TOKENS.values() if token not in token_ids]
    if lacking:
        raise ValueError(f"{name}'s vocabulary has no {', '.join(lacking)}: it is not "
                         f"Gemma 3's; give the text GGUF converted with the projector")
    image_size = int(metadata["clip.vision.image_size"])
    patch_size = int(metadata["clip.vision.patch_size"])
    scale = int(metadata.get("clip.vision.projector.scale_factor", _GEMMA3_SCALE_FACTOR))
    grid = image_size // patch_size
    if image_size % patch_size or grid % scale:
        raise ValueError(f"--mmproj {mmproj}: {image_size}-pixel images in {patch_size}-pixel "
                         f"patches do not pool by {scale}; convert the projector again with "
                         f"llama.cpp's convert_hf_to_gguf.py --mmproj")
    text = {field: value for field, value in text_config.to_dict().items()
            if field not in ("architectures", "_name_or_path")}
    config = Gemma3Config(
        architectures=[GEMMA3_ARCHITECTURE], text_config=text,
        vision_config=dict(
            hidden_size=int(metadata["clip.vision.embedding_length"]),
            intermediate_size=int(metadata["clip.vision.feed_forward_length"]),
            num_hidden_layers=int(metadata["clip.vision.block_count"]),
            num_attention_heads=int(metadata["clip.vision.attention.head_count"]),
            image_size=image_size, patch_size=patch_size, num_channels=3,
            layer_norm_eps=_float32(metadata.get("clip.vision.attention.layer_norm_epsilon",
                                                 1e-6)),
            hidden_act="gelu_pytorch_tanh", vision_use_head=False),
        mm_tokens_per_image=(grid // scale) ** 2,
        tie_word_embeddings=text_config.tie_word_embeddings,
        **{field: token_ids[token] for field, token in _GEMMA3_TOKENS.items()})
    config._name_or_path = text_config._name_or_path
    config.mmproj = os.path.abspath(mmproj)
    return config


def gemma3_tensor_target(name: str, shape: tuple[int, ...], metadata: dict[str, Any]
                         ) -> tuple[str, float]:
    """``v.blk.3.ffn_up.weight`` -> (``vision_tower.vision_model.encoder.layers.3.mlp.fc1
    .weight``, 0.0): the checkpoint name of a Gemma 3 projector tensor of ``shape``, and
    the offset the converter added to it (``mm.soft_emb_norm``: 1)."""
    if name == _GEMMA3_PROJECTION[0]:
        return _GEMMA3_PROJECTION[1], 0.0
    base, _, kind = name.rpartition(".")
    if base in _GEMMA3_GLOBAL_NAMES and kind in ("weight", "bias"):
        return (f"{_GEMMA3_GLOBAL_NAMES[base]}.{kind}",
                1.0 if name == _GEMMA3_NORM_OFFSET else 0.0)
    if (m := _BLOCK_RE.match(name)) and m.group(2) in _GEMMA3_BLOCK_NAMES:
        part = m.group(2)
        width = int(metadata["clip.vision.feed_forward_length"])
        embedding = int(metadata["clip.vision.embedding_length"])
        if part in ("ffn_up", "ffn_down") and width != embedding:
            # fc1 makes the feed-forward width, fc2 the embedding: a weight's or a bias's
            # rows say which it is, whatever an older converter named it
            part = "ffn_up" if shape[0] == width else "ffn_down"
        return (f"{_GEMMA3_TOWER}encoder.layers.{m.group(1)}.{_GEMMA3_BLOCK_NAMES[part]}."
                f"{m.group(3)}", 0.0)
    raise ValueError(f"--mmproj: the projector's tensor {name!r} is no part of Gemma 3's "
                     f"vision tower; convert the projector again from the Gemma 3 "
                     f"checkpoint (convert_hf_to_gguf.py --mmproj)")


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that is that float32 (1e-06, not
    9.99999997e-07): the number the checkpoint's config said."""
    return float(str(np.float32(value)))
