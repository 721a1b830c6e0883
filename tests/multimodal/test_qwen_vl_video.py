"""Qwen2.5-VL's video timing (loom/multimodal/qwen_vl.py): ``second_per_grid_ts``, the
seconds a temporal patch spans, is ``temporal_patch_size`` over the sampled frames'
rate as transformers' ``Qwen2_5_VLProcessor`` reads it from a video's metadata
(``VideoMetadata.sampled_fps``), for loom's ``{"fps"}`` and for vLLM's metadata, which
media.load_video returns."""

from __future__ import annotations

import numpy as np
import pytest
from multimodal.test_media import encoded_video, video_url
from vlm_checkpoints import make_tiny_qwen2_5_vl

from loom.model.loader import load_hf_config
from loom.multimodal.media import MediaPolicy, load_video
from loom.multimodal.qwen_vl import QwenVLProcessor


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> QwenVLProcessor:
    path = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_video"))
    return QwenVLProcessor(path, load_hf_config(path))


def transformers_seconds_per_patch(metadata: dict, num_frames: int) -> float:
    from transformers.video_utils import VideoMetadata

    hf_metadata = VideoMetadata(**({"total_num_frames": num_frames} | metadata))
    if "frames_indices" not in metadata:  # loom's {"fps"}: the frames' own rate
        hf_metadata.total_num_frames = None
    return 2 / hf_metadata.sampled_fps


@pytest.mark.parametrize("metadata", [
    {"fps": 1.0},
    {"fps": 29.97, "frames_indices": [0, 513, 1026, 1539], "total_num_frames": 1540,
     "duration": 1540 / 29.97},
    {"fps": 30.0, "frames_indices": [0, 10, 20, 30]},  # no frame count: the source's rate
])
def test_second_per_grid_ts_is_transformers(processor, metadata):
    frames = list(np.random.default_rng(0).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8))
    arrays, _ = processor.process_video((frames, metadata))
    want = np.float32(transformers_seconds_per_patch(metadata, 4))
    assert arrays["second_per_grid_ts"].tolist() == [want]


def test_a_video_urls_patches_span_their_frames_time(processor):
    """11 frames at 5 a second, 4 taken (0, 3, 6, 10): the frames' rate is 4 / 11 x 5,
    so a pair of frames spans 1.1 s, as transformers has it from vLLM's metadata."""
    frames, metadata = load_video(video_url(encoded_video(11, size=(84, 56))), MediaPolicy(),
                                  num_frames=4)
    arrays, rows = processor.process_video((frames, metadata))
    assert arrays["second_per_grid_ts"].tolist() == [np.float32(1.1)]
    assert arrays["second_per_grid_ts"].tolist() == [
        np.float32(transformers_seconds_per_patch(metadata, 4))]
    assert arrays["video_grid_thw"].tolist() == [[2, 4, 6]] and rows == 2 * 6
