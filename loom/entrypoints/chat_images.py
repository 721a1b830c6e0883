"""Images and videos in chat messages: taken out of the messages in order, each part
left as the ``{"type": "image"}`` or ``{"type": "video"}`` that chat templates write a
placeholder for, then loaded.

    {"type": "image_url", "image_url": {"url": ...}}   OpenAI's: the server and LLM.chat
    {"type": "image_pil", "image_pil": PIL.Image}      vLLM's: LLM.chat only
    {"type": "image", "image": PIL.Image | url}        transformers': LLM.chat only
    {"type": "video_url", "video_url": {"url": ...}}   vLLM's: the server and LLM.chat;
                                                       a video file, sampled to frames

The server's parts were checked by its protocol (protocol.py: text, image_url and
video_url parts only); the offline API's are checked here. A URL is read under the engine's
:class:`MediaPolicy` (:func:`media_policy`): data: URLs always, http(s) only from
``allowed_media_domains``, files only under ``allowed_local_media_path``. The input
processor then expands each item's placeholder into its tokens
(``InputProcessor.apply_images``).

The caller loads them off the event loop: :func:`load_chat_media` blocks on the
network and on decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from loom.config import ModelConfig
from loom.multimodal.media import (VIDEO_NUM_FRAMES, MediaError, MediaPolicy, load_image,
                                   load_video)

_IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
_VIDEO_PART_TYPES = ("video_url",)


@dataclass(frozen=True)
class ChatMedia:
    """One image or video of a conversation: where it was (``messages.0.content.1``),
    what the part gave (a URL or path to load, or an image as it is) and its modality
    ("image" or "video")."""

    where: str
    source: str | Image.Image
    modality: str = "image"


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ChatMedia]]:
    """(the messages, each image part replaced by ``{"type": "image"}`` and each video
    part by ``{"type": "video"}``; the items, in the order the template writes them). The
    messages given are not modified; a message without images or videos is passed on as
    it is. A malformed part is a ValueError naming it."""
    rendered: list[dict[str, Any]] = []
    items: list[ChatMedia] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_modality(part) for part in content):
            rendered.append(message)
            continue
        parts = []
        for number, part in enumerate(content):
            modality = _modality(part)
            if modality is not None:
                where = f"messages.{index}.content.{number}"
                items.append(ChatMedia(where, _source(part, where), modality))
                parts.append({"type": modality})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, items


def by_modality(items: list[ChatMedia]) -> dict[str, list[Any]]:
    """``items`` as ``multi_modal_data`` groups them: ``{"image": [...], "video": [...]}``
    (a modality with none left out)."""
    grouped: dict[str, list[Any]] = {}
    for item in items:
        grouped.setdefault(item.modality, []).append(item)
    return grouped


def _modality(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    return "image" if kind in _IMAGE_PART_TYPES else "video" if kind in _VIDEO_PART_TYPES \
        else None


def _source(part: dict[str, Any], where: str) -> str | Image.Image:
    kind = part["type"]
    if kind in ("image_url", "video_url"):
        media = part.get(kind)
        url = media.get("url") if isinstance(media, dict) else media
        if isinstance(url, str):
            return url
        example = "data:video/mp4;base64,..." if kind == "video_url" else \
            "data:image/png;base64,..."
        raise ValueError(f'{where}: {"a" if kind == "video_url" else "an"} {kind} part is '
                         f'{{"type": "{kind}", "{kind}": {{"url": "{example}"}}}}')
    source = part.get(kind) if kind == "image_pil" else part.get("image", part.get("url"))
    if isinstance(source, Image.Image) or (kind == "image" and isinstance(source, str)):
        return source
    raise ValueError(f'{where}: an {kind} part carries a PIL image as {{"type": "{kind}", '
                     f'"{kind}": image}}' + (' or a URL as {"type": "image", "url": ...}'
                                              if kind == "image" else ""))


def media_policy(model_config: ModelConfig) -> MediaPolicy:
    """Where the engine may read images from: its ``allowed_media_domains`` and
    ``allowed_local_media_path`` (``--allowed-media-domains``, ``--allowed-local-media-path``)."""
    video = (model_config.media_io_kwargs or {}).get("video", {})
    return MediaPolicy(allowed_domains=tuple(model_config.allowed_media_domains or ()),
                       allowed_local_path=model_config.allowed_local_media_path,
                       video_num_frames=video.get("num_frames", VIDEO_NUM_FRAMES))


def load_chat_media(item: ChatMedia, policy: MediaPolicy) -> Any:
    """The image (an RGB PIL image), or the video (its sampled frames and their fps, as
    ``multi_modal_data``'s ``"video"`` takes it), loaded under ``policy`` if the part
    gave a URL; a MediaError naming the part if it cannot be."""
    if not isinstance(item.source, str):
        return item.source
    try:
        if item.modality == "video":
            return load_video(item.source, policy)
        return load_image(item.source, policy)
    except MediaError as error:
        raise MediaError(f"{item.where}: {error}") from None
