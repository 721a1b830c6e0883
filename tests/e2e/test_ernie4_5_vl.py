"""ERNIE 4.5 VL with images: greedy tokens equal transformers' (float32) on the same tiny
random checkpoint, and so do their logprobs, to 1e-4.

Each prompt's reference is transformers' ``generate`` on that prompt alone, given the
token ids loom's processor expanded (one ``<|IMAGE_PLACEHOLDER|>`` per row of the image),
the image processor's pixels, and the processor's two token-type masks (the image's
placeholders for the 3D positions; its placeholders and start/end markers for the
vision experts). That covers the tower, the placeholder rows, the 3D rope and its delta
in decode, and the routing of each token to the text or the vision experts. loom runs
all prompts in one batch: one image, two images of different sizes, an image in a
chat-formatted prompt, text only; then in chunks of 8 tokens, which cut the 16-row
image's span (and most others) and leave markers in steps apart from their image; with
few enough KV blocks to preempt; over two tensor-parallel ranks, and over two ranks of
expert parallel. A video (sampled frames, its time drawn on each) beside an image, in
chunks, is held to the same bar, given the video's arrays as loom made them; those
arrays equal transformers' video processor's.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_checkpoints import (ERNIE_IMAGE_END_ID, ERNIE_IMAGE_ID, ERNIE_IMAGE_START_ID,
                             ERNIE_VIDEO_END_ID, ERNIE_VIDEO_ID, ERNIE_VIDEO_START_ID,
                             make_tiny_ernie4_5_vl)

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 6
IMAGE = "Picture 1:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
IMAGE_2 = "Picture 2:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
VIDEO = "Video 1:<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>"


def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (prompt text, images): 6, 16 and 4 image rows (56x84, 112x112, 56x56 pixels)
PROMPTS = [
    (f"hello {IMAGE} the fox", [image(56, 84, 1)]),
    (f"{IMAGE} and {IMAGE_2} compared", [image(112, 112, 2), image(56, 56, 3)]),
    (f"<|im_start|>user\n{IMAGE}what is it<|im_end|>\n<|im_start|>assistant\na dog"
     "<|im_end|>\n<|im_start|>user\nand the colour?<|im_end|>\n<|im_start|>assistant\n",
     [image(56, 84, 4)]),
    ("the quick brown fox jumps over the lazy dog", []),
]

CONFIGS = {
    "default": dict(),
    # chunks of 8 tokens: the 16-row image's span is cut twice at least
    "chunked_prefill": dict(max_num_batched_tokens=8),
    # few enough KV blocks that a request is preempted and its prompt, images and
    # generated tokens recomputed
    "preemption": dict(num_gpu_blocks_override=16, block_size=8, max_model_len=128),
}


def as_request(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_ernie4_5_vl(tmp_path_factory.mktemp("ernie4_5_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens and their logprobs for a prompt's token ids, images
    and video: the video's arrays as loom's processor made them (transformers' video
    processor needs torchvision), fed to transformers' model as they are."""
    from transformers import Ernie4_5_VLMoeForConditionalGeneration
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import \
        Ernie4_5_VLMoeImageProcessorPil

    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32).eval()
    processor = Ernie4_5_VLMoeImageProcessorPil.from_pretrained(checkpoint)
    vision_ids = torch.tensor([ERNIE_IMAGE_START_ID, ERNIE_IMAGE_END_ID, ERNIE_IMAGE_ID,
                               ERNIE_VIDEO_START_ID, ERNIE_VIDEO_END_ID, ERNIE_VIDEO_ID])

    answers: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def greedy(token_ids: list[int], images: list, video: dict | None = None
               ) -> tuple[list[int], list[float]]:
        if tuple(token_ids) not in answers:  # the configs' prompts are the same
            answers[tuple(token_ids)] = generate(token_ids, images, video)
        return answers[tuple(token_ids)]

    def generate(token_ids: list[int], images: list, video: dict | None
                 ) -> tuple[list[int], list[float]]:
        input_ids = torch.tensor([token_ids])
        kwargs = {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            kwargs = dict(pixel_values=pixels["pixel_values"],
                          image_grid_thw=pixels["image_grid_thw"])
        if video:
            kwargs |= {name: torch.from_numpy(array) for name, array in video.items()}
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=((input_ids == ERNIE_IMAGE_ID).int()
                                   + 2 * (input_ids == ERNIE_VIDEO_ID).int()),
                moe_mm_token_type_ids=torch.isin(input_ids, vision_ids).int(),
                max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_scores=True,
                return_dict_in_generate=True, **kwargs)
        tokens = out.sequences[0, len(token_ids):].tolist()
        logprobs = [scores[0].log_softmax(-1)[token].item()
                    for scores, token in zip(out.scores, tokens)]
        return tokens, logprobs

    return greedy


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoint, reference, config_name):
    llm = LLM(checkpoint, dtype="float32", seed=0, **({"max_model_len": 256}
                                                      | CONFIGS[config_name]))
    outputs = check_against(llm, reference, PROMPTS)
    if config_name == "preemption":
        assert llm.engine.engine_core.get_stats().num_preemptions > 0
    # each image's placeholder rows are in the prompt the engine reports
    assert list(outputs[0].prompt_token_ids).count(ERNIE_IMAGE_ID) == 6
    assert list(outputs[1].prompt_token_ids).count(ERNIE_IMAGE_ID) == 16 + 4


def test_tensor_parallel(checkpoint, reference):
    """Two ranks split the attention heads, every expert's intermediate size (text,
    vision and shared) and the vision tower."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, tensor_parallel_size=2)
    check_against(llm, reference, PROMPTS[:2])


def test_expert_parallel(checkpoint, reference):
    """Expert parallel over two ranks: each holds two of the four text experts and two of
    the four vision experts of every sparse layer (and the attention heads, split as
    tensor parallel), for images, markers and text alike."""
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, tensor_parallel_size=2,
              enable_expert_parallel=True)
    check_against(llm, reference, PROMPTS[:3])


def test_video_as_sampled_frames(checkpoint, reference):
    """A video of 7 frames at 2 fps (four frame pairs, the last frame repeated, its time
    drawn on each frame) beside an image, in chunks of 8 tokens that cut its 24 rows:
    the tower's temporal merge, its 3D positions (pairs one apart, the text after it at
    the start + max(rows, columns) = 3 merged, below its last pair's 3) and its tokens
    and markers to the vision experts give transformers' tokens and logprobs."""
    from loom.model.loader import load_hf_config
    from loom.multimodal.ernie4_5_vl import Ernie4_5_VLProcessor

    frames = [image(56, 84, 20 + i) for i in range(7)]
    video = (frames, {"fps": 2.0})
    arrays, rows = Ernie4_5_VLProcessor(checkpoint, load_hf_config(checkpoint)).process_video(
        video)
    assert rows == 4 * 6 and list(arrays["video_grid_thw"][0]) == [8, 4, 6]
    llm = LLM(checkpoint, dtype="float32", max_model_len=256, seed=0, max_num_batched_tokens=8)
    request = {"prompt": f"watch {VIDEO} then {IMAGE} what changed",
               "multi_modal_data": {"video": video, "image": image(56, 56, 9)}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                            logprobs=0)
    [output] = llm.generate([request], params, use_tqdm=False)
    assert list(output.prompt_token_ids).count(ERNIE_VIDEO_ID) == rows
    tokens, logprobs = reference(list(output.prompt_token_ids), [image(56, 56, 9)], arrays)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    got = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    np.testing.assert_allclose(got, logprobs, atol=1e-4)


@contextmanager
def transformers_video_processor(monkeypatch):
    """transformers' ``Ernie4_5_VLMoeVideoProcessor`` class, importable without
    torchvision: the few torchvision functions it calls on frames that need no resizing
    (tensor <-> PIL for drawing the timestamps, normalize), written here; the modules it
    imported are dropped afterwards."""
    import transformers.image_processing_backends as backends

    def package(name: str, **attributes) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__dict__.update(attributes, __path__=[])
        monkeypatch.setitem(sys.modules, name, module)
        return module

    def normalize(x, mean, std, inplace=False):
        shape = (-1, 1, 1)
        return (x - torch.as_tensor(mean, dtype=x.dtype).view(shape)) / \
            torch.as_tensor(std, dtype=x.dtype).view(shape)

    functional = package(
        "torchvision.transforms.functional",
        pil_to_tensor=lambda picture: torch.from_numpy(np.array(picture)).permute(2, 0, 1),
        to_pil_image=lambda tensor: Image.fromarray(tensor.permute(1, 2, 0).numpy()))
    v2_functional = package("torchvision.transforms.v2.functional", normalize=normalize)
    v2 = package("torchvision.transforms.v2", functional=v2_functional)
    package("torchvision", transforms=package("torchvision.transforms",
                                              functional=functional, v2=v2))
    monkeypatch.setattr(backends, "tvF", v2_functional, raising=False)
    before = set(sys.modules)
    try:
        from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import \
            Ernie4_5_VLMoeVideoProcessor

        yield Ernie4_5_VLMoeVideoProcessor
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]


@pytest.mark.parametrize("metadata", [
    {"fps": 1.0},  # frame i at i seconds
    # vLLM's (media.load_video's): frame i at frames_indices[i] / fps, 0 to 51.37 s
    {"fps": 29.97, "frames_indices": [0, 400, 801, 1201, 1539], "total_num_frames": 1540,
     "duration": 1540 / 29.97}])
def test_video_arrays_equal_transformers_video_processor(checkpoint, monkeypatch, metadata):
    """On frames already at their resized size (the one step whose interpolation is
    torchvision's there and PIL's here), loom's arrays for a video are transformers':
    the timestamps drawn (each frame's time from the video's metadata), the last frame
    repeated, the frames' patches in its order."""
    from transformers.video_utils import VideoMetadata

    from loom.model.loader import load_hf_config
    from loom.multimodal.ernie4_5_vl import Ernie4_5_VLProcessor

    frames = np.stack([np.asarray(image(56, 84, 20 + i)) for i in range(5)])
    arrays, _ = Ernie4_5_VLProcessor(checkpoint, load_hf_config(checkpoint)).process_video(
        (frames, metadata))
    hf_metadata = metadata if "frames_indices" in metadata else VideoMetadata(
        total_num_frames=5, fps=metadata["fps"], frames_indices=list(range(5)))
    with transformers_video_processor(monkeypatch) as video_processor_class:
        expected = video_processor_class.from_pretrained(checkpoint)(
            videos=[frames], video_metadata=[hf_metadata],
            do_sample_frames=False, do_resize=False, return_tensors="np")
    np.testing.assert_array_equal(arrays["video_grid_thw"], expected["video_grid_thw"])
    np.testing.assert_allclose(arrays["pixel_values_videos"], expected["pixel_values_videos"],
                               atol=1e-6)


def check_against(llm: LLM, reference, prompts: list) -> list:
    """loom's greedy tokens and logprobs for ``prompts``, in one batch, against
    transformers' for each alone."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                            logprobs=0)
    outputs = llm.generate([as_request(text, images) for text, images in prompts], params,
                           use_tqdm=False)
    for output, (text, images) in zip(outputs, prompts):
        completion = output.outputs[0]
        tokens, logprobs = reference(list(output.prompt_token_ids), images)
        assert list(completion.token_ids) == tokens, text
        got = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
        np.testing.assert_allclose(got, logprobs, atol=1e-4, err_msg=text)
    return outputs

