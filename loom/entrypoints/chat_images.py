"""Images in chat messages: taken out of the messages in order, each part left as the
``{"type": "image"}`` that chat templates write a placeholder for, then loaded.

    {"type": "image_url", "image_url": {"url": ...}}   OpenAI's: the server and LLM.chat
    {"type": "image_pil", "image_pil": PIL.Image}      vLLM's: LLM.chat only
    {"type": "image", "image": PIL.Image | url}        transformers': LLM.chat only

The server's parts were checked by its protocol (protocol.py: text and image_url parts
only); the offline API's are checked here. A URL is read under the engine's
:class:`MediaPolicy` (:func:`media_policy`): data: URLs always, http(s) only from
``allowed_media_domains``, files only under ``allowed_local_media_path``. The input
processor then expands each image's placeholder into its tokens
(``InputProcessor.apply_images``).

The caller loads images off the event loop: :func:`load_chat_image` blocks on the
network and on decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from loom.config import ModelConfig
from loom.multimodal.media import MediaError, MediaPolicy, load_image

_IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


@dataclass(frozen=True)
class ChatImage:
    """One image of a conversation: where it was (``messages.0.content.1``) and what the
    part gave, a URL (or path) to load or an image as it is."""

    where: str
    source: str | Image.Image


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ChatImage]]:
    """(the messages, each image part replaced by ``{"type": "image"}``; the images, in
    the order the template writes them). The messages given are not modified; a message
    without images is passed on as it is. A malformed image part is a ValueError naming
    it."""
    rendered: list[dict[str, Any]] = []
    images: list[ChatImage] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(part) for part in content):
            rendered.append(message)
            continue
        parts = []
        for number, part in enumerate(content):
            if _is_image_part(part):
                where = f"messages.{index}.content.{number}"
                images.append(ChatImage(where, _image_source(part, where)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, images


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES


def _image_source(part: dict[str, Any], where: str) -> str | Image.Image:
    kind = part["type"]
    if kind == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if isinstance(url, str):
            return url
        raise ValueError(f'{where}: an image_url part is {{"type": "image_url", "image_url": '
                         '{"url": "data:image/png;base64,..."}}')
    source = part.get(kind) if kind == "image_pil" else part.get("image", part.get("url"))
    if isinstance(source, Image.Image) or (kind == "image" and isinstance(source, str)):
        return source
    raise ValueError(f'{where}: an {kind} part carries a PIL image as {{"type": "{kind}", '
                     f'"{kind}": image}}' + (' or a URL as {"type": "image", "url": ...}'
                                              if kind == "image" else ""))


def media_policy(model_config: ModelConfig) -> MediaPolicy:
    """Where the engine may read images from: its ``allowed_media_domains`` and
    ``allowed_local_media_path`` (``--allowed-media-domains``, ``--allowed-local-media-path``)."""
    return MediaPolicy(allowed_domains=tuple(model_config.allowed_media_domains or ()),
                       allowed_local_path=model_config.allowed_local_media_path)


def load_chat_image(image: ChatImage, policy: MediaPolicy) -> Image.Image:
    """The image, loaded under ``policy`` if the part gave a URL; a MediaError naming the
    part if it cannot be."""
    if not isinstance(image.source, str):
        return image.source
    try:
        return load_image(image.source, policy)
    except MediaError as error:
        raise MediaError(f"{image.where}: {error}") from None
