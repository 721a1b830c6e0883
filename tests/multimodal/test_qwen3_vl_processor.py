"""Qwen3-VL's videos (loom/multimodal/qwen3_vl.py): the token ids and pixels loom makes
of a prompt with a video equal transformers' ``Qwen3VLProcessor``'s with its
``Qwen3VLVideoProcessor``: a timestamp and a ``<|vision_start|>``...``<|vision_end|>``
span per pair of frames, the template's wrapper collapsed, the first timestamp
tokenized with the text before it (a tokenizer that merges " <" shows it), the frames'
pixel rows to the bit.

transformers' video processor needs torchvision for three things, none of which these
videos need: converting to RGB (the frames are RGB), resizing (the frames are already
of the size its ``smart_resize`` picks: the stand-in checks that) and
``torchvision.transforms.functional.normalize``, whose arithmetic the stand-in restates
(``tensor.sub_(mean).div_(std)``). The frame size loom picks where frames are resized is
held to transformers' ``smart_resize`` directly.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image
from vlm_checkpoints import VIDEO_PAD_ID, make_tiny_qwen3_vl

from loom.model.loader import load_hf_config
from loom.multimodal.processor import MultiModalInputError
from loom.multimodal.qwen3_vl import Qwen3VLProcessor

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SPACE_ANGLE_ID = 255  # " <" in the merging tokenizer


def frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_processor"))


@pytest.fixture(scope="module")
def merging_checkpoint(checkpoint, tmp_path_factory) -> str:
    """The checkpoint with a tokenizer that merges " <" into one token (id 255), as
    real vocabularies merge punctuation runs: text before a video changes how its first
    timestamp tokenizes."""
    path = str(tmp_path_factory.mktemp("qwen3_vl_merging"))
    for name in os.listdir(checkpoint):
        shutil.copyfile(os.path.join(checkpoint, name), os.path.join(path, name))
    with open(os.path.join(path, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    # in place of its last merge, "½" + "ł" (id 255), which no text here holds
    vocab, merges = tokenizer["model"]["vocab"], tokenizer["model"]["merges"]
    vocab["Ġ<"] = vocab.pop("½ł")
    merges[merges.index(["½", "ł"])] = ["Ġ", "<"]
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    return path


@pytest.fixture(scope="module")
def hf_processor():
    """transformers' Qwen3VLProcessor for a checkpoint, with torchvision's share stood in
    for (the module docstring)."""
    import torch
    from transformers import AutoTokenizer, ProcessorMixin, image_processing_backends
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import \
        Qwen3VLProcessor as HFQwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    def normalize(self, image, mean, std, inplace=False, **kwargs):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return image.sub(mean).div(std)

    def resize(self, image, size, **kwargs):
        assert tuple(image.shape[-2:]) == (size.height, size.width), "a frame to resize"
        return image

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Qwen3VLVideoProcessor, "normalize", normalize)
        patch.setattr(image_processing_backends.TorchvisionBackend, "resize", resize)
        # its class check looks the video processor up in a registry torchvision fills
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, argument: None)

        def build(path: str):
            return HFQwen3VLProcessor(
                image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                tokenizer=AutoTokenizer.from_pretrained(path),
                video_processor=Qwen3VLVideoProcessor.from_pretrained(path))

        yield build


@pytest.mark.parametrize("text, fps, indices", [
    (f"watch {VIDEO} now", 1.0, None),  # 5 frames: 3 patches, the last frame repeated
    (f"{VIDEO}", 2.0, None),  # the prompt opens with it
    (f"a{VIDEO}b", 30.0, [0, 37, 75, 112, 150]),  # vLLM's metadata: the video's rate
    (f"{IMAGE} then {VIDEO} and{VIDEO}", 3.0, None),  # an image, the same video twice
])
def test_video_prompt_and_pixels_match_transformers(checkpoint, merging_checkpoint,
                                                    hf_processor, text, fps, indices):
    video = frames(5, 64, 96, seed=1)
    images = [Image.fromarray(frames(1, 64, 64, seed=2)[0])] if IMAGE in text else []
    metadata = {"fps": fps} | ({"frames_indices": indices} if indices else {})
    hf_metadata = {"fps": fps, "frames_indices": indices or list(range(5)),
                   "total_num_frames": (indices or [4])[-1] + 1}
    count = text.count(VIDEO)
    for path in (checkpoint, merging_checkpoint):
        processor = Qwen3VLProcessor(path, load_hf_config(path))
        token_ids, features = processor.apply(
            processor.tokenizer.encode(text, add_special_tokens=False), images,
            [(video, metadata)] * count)
        expected = hf_processor(path)(
            text=[text], images=images or None, videos=[video] * count,
            video_metadata=[hf_metadata] * count, do_sample_frames=False,
            do_convert_rgb=False, return_tensors="np")
        assert token_ids == expected["input_ids"][0].tolist(), path
        videos = [f for f in features if f.modality == "video"]
        assert len(videos) == 3 * count
        assert all(token_ids[f.offset:f.end] == [VIDEO_PAD_ID] * 6 for f in videos)
        assert np.array_equal(
            np.concatenate([f.data["pixel_values_videos"].to_array() for f in videos]),
            expected["pixel_values_videos"])
        assert all(f.data["video_grid_thw"].to_array().tolist() == [[1, 4, 6]] for f in videos)
    # the merging tokenizer joined " <" of the first timestamp after "watch"
    if text.startswith("watch"):
        assert SPACE_ANGLE_ID in token_ids


def test_frame_size_matches_transformers_smart_resize(checkpoint):
    """Frames of other sizes are resized to what transformers' smart_resize picks for the
    whole video (the pixels then differ by interpolation: PIL's against torchvision's)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import \
        smart_resize as hf_smart_resize

    from loom.multimodal.qwen3_vl import smart_resize

    for num_frames in (2, 3, 8, 33):
        for height, width in [(20, 300), (64, 96), (97, 131), (480, 640), (1080, 1920)]:
            for min_pixels, max_pixels in [(2048, 65536), (4096, 25165824),
                                           (128 * 32 * 32, 32 * 32 * 768)]:
                assert smart_resize(num_frames, height, width, 2, 32, min_pixels, max_pixels) \
                    == hf_smart_resize(num_frames, height, width, 2, 32, min_pixels, max_pixels)
    processor = Qwen3VLProcessor(checkpoint, load_hf_config(checkpoint))
    arrays, rows = processor.process_video((frames(4, 100, 180, seed=3), {"fps": 2.0}))
    # 4 frames of 100 x 180 hold 72,000 pixels, over 65,536: 64 x 160 (4 x 10 patches)
    assert arrays["video_grid_thw"].tolist() == [[2, 4, 10]] and rows == 2 * 10
    assert arrays["timestamps"].tolist() == [0.25, 1.25]


def test_bad_videos_are_refused(checkpoint):
    processor = Qwen3VLProcessor(checkpoint, load_hf_config(checkpoint))
    ids = processor.tokenizer.encode(VIDEO, add_special_tokens=False)
    with pytest.raises(MultiModalInputError, match="at least 2 frames"):
        processor.apply(ids, [], [frames(1, 64, 64, seed=0)])
    with pytest.raises(MultiModalInputError, match="3 frames_indices for 4 frames"):
        processor.apply(ids, [], [(frames(4, 64, 64, seed=0), {"frames_indices": [0, 1, 2]})])
    with pytest.raises(MultiModalInputError, match="fps must be positive, not 0"):
        processor.apply(ids, [], [(frames(4, 64, 64, seed=0), {"fps": 0})])
    with pytest.raises(MultiModalInputError, match="metadata is a dict"):
        processor.apply(ids, [], [(frames(4, 64, 64, seed=0), [2.0])])
    with pytest.raises(MultiModalInputError, match="all be of one size"):
        processor.apply(ids, [], [[frames(1, 64, 64, 0)[0], frames(1, 32, 64, 0)[0]]])
    with pytest.raises(MultiModalInputError, match="1 video placeholders but 2 videos"):
        processor.apply(ids, [], [frames(2, 64, 64, 0)] * 2)


def test_a_video_urls_frames_keep_their_times(checkpoint, hf_processor):
    """A video_url of 11 frames at 5 a second, 4 asked: media.load_video takes frames 0,
    3, 6 and 10 (vLLM's indices; not evenly spread over its 2.2 s) with vLLM's metadata,
    and the prompt ids equal transformers' processor's for the same frames and metadata:
    each pair at its frames' own times (0 and 0.6 s, 1.2 and 2.0 s), not at times spread
    evenly over the video."""
    from multimodal.test_media import encoded_video, video_url

    from loom.multimodal.media import MediaPolicy, load_video

    url = video_url(encoded_video(11, size=(96, 64)))
    frames, metadata = load_video(url, MediaPolicy(), num_frames=4)
    assert metadata == {"fps": 5.0, "frames_indices": [0, 3, 6, 10], "total_num_frames": 11,
                        "duration": 2.2}
    text = f"watch {VIDEO} now"
    processor = Qwen3VLProcessor(checkpoint, load_hf_config(checkpoint))
    token_ids, _ = processor.apply(processor.tokenizer.encode(text, add_special_tokens=False),
                                   [], [(frames, metadata)])
    expected = hf_processor(checkpoint)(
        text=[text], videos=[np.stack([np.asarray(frame) for frame in frames])],
        video_metadata=[metadata], do_sample_frames=False, do_convert_rgb=False,
        return_tensors="np")
    assert token_ids == expected["input_ids"][0].tolist()
    prompt = processor.tokenizer.decode(token_ids)
    assert "<0.3 seconds>" in prompt and "<1.6 seconds>" in prompt
