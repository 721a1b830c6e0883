"""Tokenizer: text ↔ token ids, end-of-sequence ids and chat templates for one model.

`load_tokenizer` reads a Hugging Face directory (tokenizer.json, tokenizer_config.json,
generation_config.json) or a single `.gguf` file. Converting a GGUF vocabulary into a
Hugging Face tokenizer takes seconds, so the converted tokenizer is saved once under
`$LOOM_CACHE_DIR/tokenizers/<key>` (default `~/.cache/loom`) and reused while the file's
path, size and mtime are unchanged.

Streaming text out of generated ids lives in `loom/detokenizer.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from loom.envs import settings

if TYPE_CHECKING:  # imported where a tokenizer loads: `loom serve` binds its port first
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Metadata ids that end generation in llama.cpp: end of sequence, end of turn, end of message.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                  "tokenizer.ggml.eom_token_id")
_GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# Architectures whose config transformers does not read from a GGUF file (loom does:
# model/loader/gguf_configs.py), so its AutoTokenizer cannot choose a class for them;
# their vocabulary is converted by the same code into a plain fast tokenizer.
_GGUF_ARCHITECTURES_WITHOUT_HF_CONFIG = ("ernie4_5", "ernie4_5-moe", "qwen2vl")
# Architectures whose AutoTokenizer class is SentencePiece's (GemmaTokenizer): a file of
# theirs with a GPT-2 BPE vocabulary (convert_hf_to_gguf.py writes one for a checkpoint
# without tokenizer.model) converts into a plain fast tokenizer too, which the cache
# reloads as saved (GemmaTokenizer reloads it without its byte-level pre-tokenizer).
_GGUF_SENTENCEPIECE_ARCHITECTURES = ("gemma3",)
_CACHE_META_FILE = "loom_tokenizer.json"


class Tokenizer:
    """A Hugging Face tokenizer plus what the engine needs beside it.

    Decoding never applies `clean_up_tokenization_spaces` (a BERT-era rewrite of " ." to
    "." and the like): it makes decode(a + b) differ from decode(a) + decode(b), which the
    incremental detokenizer relies on.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: list[int], name: str) -> None:
        self.hf = hf
        self.eos_token_ids = eos_token_ids
        self.name = name

    @property
    def vocab_size(self) -> int:
        """Size of the full vocabulary, added tokens included (`hf.vocab_size` excludes them)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        # spaces_between_special_tokens only changes Python ("slow") tokenizers.
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False,
                              spaces_between_special_tokens=spaces_between_special_tokens)

    def render_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                             tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for OpenAI-style messages; extra kwargs reach the template."""
        if not self.hf.chat_template:
            raise ValueError(f"model {self.name} has no chat template; pass --chat-template "
                             "with a Jinja template or a file holding one")
        return self.hf.apply_chat_template(
            [template_message(message) for message in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """The prompt token ids for OpenAI-style messages.

        The template writes any BOS token itself, so encoding adds no special tokens.
        """
        text = self.render_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI chat message as chat templates expect it, as vLLM renders it.

    - content: null or missing -> "" (an assistant turn that only calls tools sends null);
      a list of text parts ([{"type": "text", "text": ...}, ...]) -> the texts joined by "\n";
      a list with image parts (``{"type": "image"}``, which the chat layer writes for each
      image it takes out of the messages) -> the parts as they are, in order, for the
      template to write each image's placeholder where it stands.
    - tool_calls: each call's ``function.arguments``, a JSON string from the client, -> the
      object it encodes (templates write ``arguments | tojson`` or iterate its items);
      missing, empty or not a JSON object -> {}, since failing here would fail every later
      turn of that conversation. An empty list is dropped.
    - everything else (role, name, tool_call_id, ...) passes through.

    The caller's message is not modified.
    """
    rendered = {**message, "content": _template_content(message.get("content"))}
    tool_calls = message.get("tool_calls")
    if tool_calls is None or tool_calls == []:
        rendered.pop("tool_calls", None)
        return rendered
    if not isinstance(tool_calls, list):
        raise ValueError(f"tool_calls must be a list of calls, not {type(tool_calls).__name__}")
    rendered["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return rendered


def _template_content(content: Any) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of text parts, "
                         f"not {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" \
                and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif isinstance(part, dict) and part.get("type") in ("image", "video"):
            parts.append({"type": part["type"]})  # the template writes its placeholder
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message content part of type {kind!r} is not supported; "
                             "only text parts ({'type': 'text', 'text': ...}), image parts "
                             "({'type': 'image'}) and video parts ({'type': 'video'}) are")
    if any(part["type"] != "text" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _template_tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ValueError("each of an assistant message's tool_calls must be "
                         '{"type": "function", "function": {"name": ..., "arguments": ...}}')
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            logger.warning("tool call %r has arguments that are not JSON (%d chars); "
                           "rendering them as {}", function.get("name"), len(arguments))
            arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def load_tokenizer(model_path: str, tokenizer_path: str | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    """Load the tokenizer of `model_path` (an HF directory or a .gguf file).

    tokenizer_path: where the tokenizer lives when not beside the model.
    chat_template: a Jinja template, or a file holding one, replacing the model's own.
    """
    source = tokenizer_path or model_path
    if not os.path.exists(source):
        raise FileNotFoundError(f"tokenizer path {source} does not exist; pass a Hugging Face "
                                "model directory or a .gguf file")
    if _is_gguf(source):
        hf, eos_token_ids = _load_gguf_tokenizer(source)
    else:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(source)
        eos_token_ids = _eos_ids_from_generation_config([model_path, source])
        if hf.eos_token_id is not None and hf.eos_token_id not in eos_token_ids:
            eos_token_ids.append(hf.eos_token_id)
    if chat_template is not None:
        hf.chat_template = _read_chat_template(chat_template)
    if not eos_token_ids:
        logger.warning("tokenizer of %s names no eos token; generation stops only at max_tokens "
                       "or a stop string", source)
    return Tokenizer(hf, eos_token_ids, name=model_path)


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _eos_ids_from_generation_config(dirs: list[str]) -> list[int]:
    """eos_token_id (an int or a list) from the first generation_config.json found in dirs."""
    for directory in dirs:
        config_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is None:
                return []
            return list(dict.fromkeys(eos if isinstance(eos, list) else [eos]))
    return []


def _read_chat_template(chat_template: str) -> str:
    if os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    raise ValueError(f"chat template {chat_template!r} is neither an existing file nor a Jinja "
                     "template; pass a template string or the path of a file holding one")


def _load_gguf_tokenizer(gguf_path: str) -> tuple[PreTrainedTokenizerBase, list[int]]:
    from transformers import AutoTokenizer

    from loom.torch_free import torch_forbidden

    cache_dir = _gguf_cache_dir(gguf_path)
    meta_path = os.path.join(cache_dir, _CACHE_META_FILE)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            eos_token_ids = json.load(f)["eos_token_ids"]
        return AutoTokenizer.from_pretrained(cache_dir), eos_token_ids

    from loom.progress import progress

    progress(f"converting the tokenizer of {os.path.basename(gguf_path)} (first use) ...")
    if torch_forbidden():
        hf, eos_token_ids = _convert_in_child(gguf_path)
    else:
        hf, eos_token_ids = _convert_gguf_tokenizer(gguf_path)
    _save_to_cache(hf, eos_token_ids, cache_dir)
    return hf, eos_token_ids


def _convert_gguf_tokenizer(gguf_path: str) -> tuple[PreTrainedTokenizerBase, list[int]]:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    metadata = _read_gguf_metadata(gguf_path, (*_GGUF_EOS_KEYS, _GGUF_CHAT_TEMPLATE_KEY,
                                               "general.architecture", "tokenizer.ggml.model"))
    architecture = metadata.get("general.architecture")
    gpt2_vocabulary = (architecture in _GGUF_SENTENCEPIECE_ARCHITECTURES
                       and metadata.get("tokenizer.ggml.model") == "gpt2")
    tokenizer_cls = (PreTrainedTokenizerFast if gpt2_vocabulary or architecture
                     in _GGUF_ARCHITECTURES_WITHOUT_HF_CONFIG else AutoTokenizer)
    hf = tokenizer_cls.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                       gguf_file=os.path.basename(gguf_path))
    eos_token_ids = list(dict.fromkeys(int(metadata[key]) for key in _GGUF_EOS_KEYS if key in metadata))
    if not hf.chat_template and _GGUF_CHAT_TEMPLATE_KEY in metadata:
        hf.chat_template = metadata[_GGUF_CHAT_TEMPLATE_KEY]
    return hf, eos_token_ids


def save_gguf_tokenizer(gguf_path: str, directory: str) -> list[int]:
    """Convert the tokenizer of ``gguf_path`` and save it into ``directory``; returns its
    eos ids. The child process's part of :func:`_convert_in_child`."""
    hf, eos_token_ids = _convert_gguf_tokenizer(gguf_path)
    hf.save_pretrained(directory)
    return eos_token_ids


def _convert_in_child(gguf_path: str) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """transformers reads a GGUF file with torch, which a process that forbade it (the
    API server, an engine core; loom/torch_free.py) cannot import: a child converts and
    saves the tokenizer, this process loads that copy (as it would the cached one)."""
    from transformers import AutoTokenizer

    from loom.torch_free import call_with_torch

    staging = tempfile.mkdtemp(prefix="loom-tokenizer-")
    try:
        eos_token_ids = call_with_torch("loom.tokenizer:save_gguf_tokenizer", gguf_path, staging)
        return AutoTokenizer.from_pretrained(staging), eos_token_ids
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_gguf_metadata(gguf_path: str, keys: tuple[str, ...]) -> dict[str, Any]:
    # loom's header reader (milliseconds, and the config has parsed this file already),
    # not gguf.GGUFReader (seconds for a 50k-token vocabulary)
    from loom.model.loader.hf_config import open_gguf

    metadata = open_gguf(gguf_path).metadata
    return {key: metadata[key] for key in keys if key in metadata}


def _gguf_cache_dir(gguf_path: str) -> str:
    import transformers

    stat = os.stat(gguf_path)
    key_text = f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    return str(settings().cache_dir / "tokenizers" / key)


def _save_to_cache(hf: PreTrainedTokenizerBase, eos_token_ids: list[int], cache_dir: str) -> None:
    """Write into a temporary sibling, then rename, so a reader never sees half a cache entry."""
    parent = os.path.dirname(cache_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent, prefix=".staging-")
    except OSError as error:  # e.g. a read-only home
        logger.debug("not caching tokenizer in %s: %s", cache_dir, error)
        return
    try:
        hf.save_pretrained(staging)
        with open(os.path.join(staging, _CACHE_META_FILE), "w") as f:
            json.dump({"eos_token_ids": eos_token_ids}, f)
        os.rename(staging, cache_dir)
    except OSError as error:  # e.g. another process renamed its copy first
        logger.debug("not caching tokenizer in %s: %s", cache_dir, error)
        shutil.rmtree(staging, ignore_errors=True)
