"""InputProcessor: a user's prompt and sampling params -> validated token ids.

Shared by the offline ``LLMEngine`` and the API server, so both accept and reject
exactly the same inputs. Each rejection is a ``ValueError`` subclass that names the
field at fault, so the server can answer 400 with ``param`` filled in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from loom.config import ModelConfig, StructuredOutputsConfig
from loom.core.wire import MultiModalFeature
from loom.sampling_params import SamplingParams, longest_prompt
from loom.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]


class InvalidInputError(ValueError):
    """A prompt or parameter the engine cannot take; ``param`` names it."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidInputError):
    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param, code="context_length_exceeded")


# what a pooling engine answers, by task (loom/pooling.py)
_TASK_ROUTES = {"embed": "/v1/embeddings", "score": "/v1/rerank or /score",
                "classify": "/classify"}


class ProcessedPrompt(NamedTuple):
    text: str | None
    token_ids: list[int]
    mm_features: list[MultiModalFeature]


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Tokenizer,
                 structured_outputs_config: StructuredOutputsConfig | None = None,
                 scheduling_policy: str = "fcfs") -> None:
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = model_config.max_logprobs
        self.reasoning_budget = model_config.reasoning_budget
        self.reasoning_budget_message = model_config.reasoning_budget_message
        self._think_ids: tuple[int, int] | None | bool = False  # False: not looked up yet
        self.vocab_size = model_config.vocab_size or tokenizer.vocab_size
        self.tokenizer = tokenizer
        self.structured_outputs_config = structured_outputs_config
        if structured_outputs_config is not None \
                and structured_outputs_config.backend == "xgrammar":
            from loom.structured_output.grammar import load_xgrammar

            load_xgrammar()  # it checks every constraint: imported now, not on a request's path
        self.scheduling_policy = scheduling_policy
        self.task = model_config.task
        self.pooler = model_config.pooler
        self._classifier_ids: tuple[int, int] | None = None
        self.model_path = model_config.model
        self.hf_config = model_config.hf_config
        self.limit_mm_per_prompt = dict(model_config.limit_mm_per_prompt or {})
        self._mm_processor: Any = False  # False: not looked up yet; None: text only

    @property
    def mm_processor(self) -> Any:
        """The family's ``MultiModalProcessor`` (loom/multimodal/processor.py), or None
        for a text-only model."""
        if self._mm_processor is False:
            self._mm_processor = None
            if self.hf_config is not None:
                from loom.model.loader.hf_config_values import HFConfigView
                from loom.model.models.registry import get_model_architecture
                from loom.multimodal.processor import is_multimodal, processor_for

                hf_config = HFConfigView.from_values(self.hf_config)
                architecture = get_model_architecture(hf_config)
                if is_multimodal(architecture):
                    self._mm_processor = processor_for(self.model_path, architecture,
                                                       hf_config)
        return self._mm_processor

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, validated prompt token ids) of a text-only prompt."""
        text, token_ids, mm_features = self.process(prompt)
        if mm_features:
            raise InvalidInputError("this call takes text prompts only; give prompts with "
                                    "images to generate or chat", "multi_modal_data")
        return text, token_ids

    def process(self, prompt: PromptType) -> ProcessedPrompt:
        """A prompt's text (or None), validated token ids and images (vLLM's
        ``{"prompt": ..., "multi_modal_data": {"image": image_or_list}}``; ``"video"``:
        a video's frames, or a list of videos, where the model takes video), each item's
        placeholder token repeated once per row of it."""
        items = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            items = self.check_multi_modal_data(prompt["multi_modal_data"])
        text, token_ids = self._prompt_tokens(prompt)
        features: list[MultiModalFeature] = []
        if items:
            token_ids, features = self.apply_images(token_ids, items["image"],
                                                    videos=items["video"])
        self.validate_prompt(token_ids)
        return ProcessedPrompt(text, token_ids, features)

    def check_images(self, data: Any, param: str = "multi_modal_data") -> list[Any]:
        """The images of ``multi_modal_data`` (``{"image": image_or_list}``) as a list;
        see ``check_multi_modal_data``."""
        return self.check_multi_modal_data(data, param)["image"]

    def check_media_counts(self, counts: dict[str, int], param: str = "messages") -> None:
        """Before any item is loaded: a 400's error where the model takes none of these
        modalities (``{"image": 2, "video": 1}``), or more than the limit of one."""
        processor = self.mm_processor
        if processor is None:
            raise InvalidInputError("this model is text-only: it takes no images; serve a "
                                    "multimodal checkpoint to send images", param)
        other = sorted(set(counts) - set(processor.modalities))
        if other:
            raise InvalidInputError(f"this model takes {' and '.join(processor.modalities)} "
                                    f"only, not {', '.join(other)}", param)
        for modality, count in counts.items():
            limit = self.limit_mm_per_prompt.get(modality)
            if limit is not None and count > limit:
                raise InvalidInputError(f"{count} {modality}s in one prompt, but at most "
                                        f"{limit} are allowed (--limit-mm-per-prompt)", param)

    def check_multi_modal_data(self, data: Any, param: str = "multi_modal_data"
                               ) -> dict[str, list[Any]]:
        """``multi_modal_data``'s items by modality ("image", "video"), each a list; a
        400's error where the model takes none, takes another modality, or there are
        more than the limit. A video is a list of frames (or a (T, H, W, 3) array), so
        ``"video"`` is one video unless it is a list of such."""
        if not isinstance(data, dict):
            raise InvalidInputError("multi_modal_data is a dict such as {'image': image}",
                                    param)
        items = {"image": _as_list(data.get("image")), "video": _videos(data.get("video"))}
        self.check_media_counts({modality: len(items.get(modality, ())) for modality in data},
                                param)
        return items

    def apply_images(self, token_ids: list[int], images: list[Any],
                     param: str = "multi_modal_data", videos: list[Any] = ()
                     ) -> tuple[list[int], list[MultiModalFeature]]:
        """``token_ids`` with each placeholder expanded, and the items' features."""
        from loom.multimodal.processor import MultiModalInputError

        try:
            if videos:
                return self.mm_processor.apply(token_ids, images, videos)
            return self.mm_processor.apply(token_ids, images)
        except MultiModalInputError as error:
            raise InvalidInputError(str(error), param) from None
        except Exception as error:  # noqa: BLE001 — the image processor failed on an item
            raise InvalidInputError(f"an image could not be processed: "
                                    f"{type(error).__name__}: {error}", param) from None

    def _prompt_tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            text, token_ids = None, list(prompt)
        else:
            raise TypeError(f"a prompt is a string, a list of token ids or a dict, "
                            f"not {type(prompt).__name__}")
        return text, token_ids

    def validate_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise InvalidInputError("the prompt is empty; give at least one token", param)
        if len(token_ids) > longest_prompt(self.max_model_len, self.task != "generate"):
            raise ContextLengthError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                "shorten it or raise --max-model-len", param)
        for token_id in token_ids:
            if (not isinstance(token_id, int) or isinstance(token_id, bool)
                    or not 0 <= token_id < self.vocab_size):
                raise InvalidInputError(f"prompt token id {token_id!r} is outside the vocabulary "
                                        f"[0, {self.vocab_size})", param)

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this vocabulary, the
        request's task against the engine's."""
        self._check_task(params)
        for token_id in params.logit_bias or ():
            if not 0 <= int(token_id) < self.vocab_size:
                raise InvalidInputError(f"logit_bias names token {token_id} outside the vocabulary "
                                        f"[0, {self.vocab_size})", "logit_bias")
        for token_id in params.allowed_token_ids or ():
            if not 0 <= token_id < self.vocab_size:
                raise InvalidInputError(f"allowed_token_ids names token {token_id} outside the "
                                        f"vocabulary [0, {self.vocab_size})", "allowed_token_ids")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        for sequence in params.bad_words_token_ids or ():
            if not all(0 <= token_id < self.vocab_size for token_id in sequence):
                raise InvalidInputError(f"bad_words_token_ids names a token outside the "
                                        f"vocabulary [0, {self.vocab_size})",
                                        "bad_words_token_ids")
        if params.priority != 0 and self.scheduling_policy != "priority":
            raise InvalidInputError(f"priority {params.priority} needs the priority scheduling "
                                    "policy; start the engine with --scheduling-policy "
                                    "priority", "priority")
        self._apply_reasoning_budget(params)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidInputError(f"{name} must be at most {self.max_logprobs} (the "
                                        f"engine's max_logprobs), got {value}", name)
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidInputError(f"stop_token_ids names token {token_id} outside the "
                                        f"vocabulary [0, {self.vocab_size})", "stop_token_ids")
        if params.structured_outputs is not None and self.structured_outputs_config is not None \
                and not self.structured_outputs_config.enabled:
            raise InvalidInputError("structured outputs are off on this server "
                                    "(--structured-outputs-backend off); restart it with "
                                    "--structured-outputs-backend auto to constrain outputs",
                                    "structured_outputs")
        if params.structured_outputs is not None:
            # Compiling here (well under a millisecond, no tokenizer needed) makes a bad
            # schema, regex or grammar this request's error, never the engine core's.
            from loom.structured_output import GrammarError, validate_structured_outputs

            try:
                validate_structured_outputs(params.structured_outputs,
                                            self.structured_outputs_config)
            except GrammarError as error:
                raise InvalidInputError(str(error), "structured_outputs") from None

    def _check_task(self, params: SamplingParams) -> None:
        """A generation request to a pooling engine, or a pooling request to a generating
        one (or for the other pooling task), is the request's error; a pooling request's
        ``dimensions`` is checked and a score's yes/no token ids are set."""
        pooling = params.pooling
        if pooling is None:
            if self.task != "generate":
                raise InvalidInputError(
                    f"this model serves --task {self.task}: it pools prompts and generates "
                    f"nothing; use {_TASK_ROUTES[self.task]} (or start an engine with --task "
                    "generate)", "model")
            return
        if self.task != pooling.task:
            raise InvalidInputError(
                f"this model serves --task {self.task}; a {pooling.task} request needs an "
                f"engine started with --task {pooling.task}", "model")
        problem = self.pooler.check_dimensions(pooling.dimensions)
        if problem is not None:
            raise InvalidInputError(problem, "dimensions")
        if pooling.task == "score" and pooling.classifier_token_ids is None \
                and not self.pooler.cross_encoder:  # (a cross-encoder's head scores)
            pooling.classifier_token_ids = self.classifier_token_ids()

    def classifier_token_ids(self) -> tuple[int, int]:
        """The reranker's (no, yes) token ids: each of ``classifier_from_token`` one token."""
        if self._classifier_ids is None:
            ids = []
            for text in self.pooler.classifier_from_token:
                encoded = self.tokenizer.encode(text, add_special_tokens=False)
                if len(encoded) != 1:
                    raise InvalidInputError(
                        f"the score token {text!r} is {len(encoded)} tokens for this "
                        "tokenizer; set --pooler-config classifier_from_token to two "
                        "single-token strings", "model")
                ids.append(encoded[0])
            self._classifier_ids = (ids[0], ids[1])
        return self._classifier_ids

    def _apply_reasoning_budget(self, params: SamplingParams) -> None:
        """Resolve the request's reasoning budget (its own, else the engine's default)
        into what the sampler forces once it is spent: </think>, after the budget
        message's tokens. A budget the request asks for on a tokenizer without <think> and
        </think> is a 400; the engine's default applies only where they exist."""
        asked = params.thinking_token_budget
        budget = self.reasoning_budget if asked is None else asked
        if budget < 0 or params.think_forced_ids is not None:
            return
        if params.structured_outputs is not None and params.grammar_after_thinking is None:
            return  # the grammar writes every token: no thinking for a budget to end
        think_ids = self.think_token_ids()
        if think_ids is None:
            if asked is not None:
                raise InvalidInputError("thinking_token_budget needs a thinking model: this "
                                        "tokenizer has no <think> and </think> tokens",
                                        "thinking_token_budget")
            return
        message = (self.tokenizer.encode(self.reasoning_budget_message, add_special_tokens=False)
                   if self.reasoning_budget_message else [])
        params.thinking_token_budget = budget
        params.think_start_id = think_ids[0]
        params.think_forced_ids = [*message, think_ids[1]]

    def think_token_ids(self) -> tuple[int, int] | None:
        """The ids of <think> and </think> (the seed's think_end_id), or None where the
        tokenizer has no such tokens."""
        if self._think_ids is False:
            hf = getattr(self.tokenizer, "hf", None)
            vocab = hf.get_vocab() if hf is not None else {}
            ids = (vocab.get("<think>"), vocab.get("</think>"))
            self._think_ids = ids if None not in ids else None
        return self._think_ids


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _videos(value: Any) -> list[Any]:
    """One video (its frames: a list of images, or an array) or a list of videos."""
    if value is None:
        return []
    if isinstance(value, list) and value and (
            isinstance(value[0], (list, tuple)) or getattr(value[0], "ndim", 0) == 4):
        return value
    return [value]


def bad_words_token_ids(bad_words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each bad word's token ids as written, and again with a leading space where that
    tokenizes to other tokens of the same count (a word mid-sentence), as vLLM does."""
    sequences: list[list[int]] = []
    for word in bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return [sequence for sequence in sequences if sequence]
