"""OpenAIServing: what the serving classes (chat, completion, tokenize) share.

Each route's class reads top to bottom in the order its request flows:

    parse (protocol: Model.parse) -> check_model -> prompt token ids
    -> SamplingParams (protocol: request.to_sampling_params) -> check_params
    -> submit (engine.add_request) -> _full (one JSON answer) or _stream (SSE events)

Below the class: the two pieces of output formatting both generation routes use.
"""

from __future__ import annotations

import asyncio
import math

from loom.async_llm import AsyncLLM, RequestStream
from loom.core.kv_transfer import KVTransferParamsError, check_kv_transfer_params
from loom.core.wire import MultiModalFeature
from loom.entrypoints.chat_images import ChatMedia, by_modality, load_chat_media, media_policy
from loom.entrypoints.openai.errors import RequestError, engine_error, model_not_found
from loom.input_processor import InvalidInputError
from loom.multimodal.media import MediaError
from loom.outputs import Logprob
from loom.sampling_params import SamplingParams

# What vLLM reports for an impossible token (the sampler's LOGPROB_FLOOR; not imported,
# to keep torch out of the API process).
_LOGPROB_FLOOR = -9999.0


class OpenAIServing:
    """The engine, the served model's name and limits, and the steps around the engine."""

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = engine.config.model.max_model_len
        self.max_logprobs = engine.config.model.max_logprobs
        self.effort_budgets = engine.config.model.reasoning_effort_budgets
        # The model's generation config: what a request leaves out.
        self.default_sampling_params = engine.config.model.default_sampling_params
        # LoRA adapters served beside the base, by name (a request's model): the engine's
        # live set, which /v1/load_lora_adapter and /v1/unload_lora_adapter change
        self.lora_names = engine.lora_names
        # where image URLs may be read from (--allowed-media-domains, --allowed-local-media-path)
        self.media_policy = media_policy(engine.config.model)

    def check_model(self, requested: str | None) -> str | None:
        """The LoRA adapter ``requested`` names (loom/lora.py), None for the base model; a
        404 for a name the server does not serve. (``use_lora`` sets it on the params.)"""
        if requested is None or requested == self.model_name:
            return None
        if requested in self.lora_names:
            return requested
        raise model_not_found(requested)

    def use_lora(self, params: SamplingParams, lora_name: str | None) -> None:
        """Run ``params``' request with adapter ``lora_name`` (None: the base), as loaded."""
        params.lora_name = lora_name
        params.lora_id = self.lora_names.get(lora_name, 0) if lora_name else 0

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """What the request alone cannot tell: its token ids against this vocabulary,
        its grammar compiled, its kv_transfer_params against this instance's role."""
        try:
            self.engine.input_processor.validate_params(params)
        except InvalidInputError as error:
            raise RequestError.from_invalid_input(error) from None
        if not params.kv_transfer_params:
            return
        config = self.engine.config
        try:
            check_kv_transfer_params(params.kv_transfer_params, config.kv_transfer,
                                     config.parallel.tensor_parallel_size,
                                     config.cache.block_size, num_prompt_tokens, params.n,
                                     params.prompt_logprobs)
        except KVTransferParamsError as error:
            raise RequestError(str(error), param=error.param) from None

    def check_images(self, items: list[ChatMedia]) -> None:
        """Before any is loaded: a 400 where the model takes no images (or videos), or
        more than --limit-mm-per-prompt are given."""
        try:
            self.engine.input_processor.check_media_counts(
                {modality: len(group) for modality, group in by_modality(items).items()})
        except InvalidInputError as error:
            raise RequestError.from_invalid_input(error) from None

    async def apply_images(self, token_ids: list[int], items: list[ChatMedia]
                           ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each image's (and video's) placeholder expanded into its
        tokens, and their features. Loading (the network, decoding) and the processor run
        in worker threads, never on the event loop; an item that cannot be loaded or
        processed is a 400 naming it."""
        processor = self.engine.input_processor
        try:
            loaded = await asyncio.gather(*(asyncio.to_thread(load_chat_media, item,
                                                              self.media_policy)
                                            for item in items))
            images = [one for one, item in zip(loaded, items) if item.modality == "image"]
            videos = [one for one, item in zip(loaded, items) if item.modality == "video"]
            return await asyncio.to_thread(processor.apply_images, token_ids, images,
                                           "messages", videos)
        except MediaError as error:
            raise RequestError(str(error), param="messages") from None
        except InvalidInputError as error:
            raise RequestError.from_invalid_input(error) from None

    def submit(self, request_id: str, prompt: str | None, token_ids: list[int],
               params: SamplingParams, stream: bool,
               mm_features: list[MultiModalFeature] | None = None) -> RequestStream:
        """Hand a checked request to the engine; a 503 when its queue is full, a 500 when
        it is dead."""
        try:
            return self.engine.add_request(request_id, prompt, token_ids, params, stream=stream,
                                           mm_features=mm_features)
        except Exception as error:  # noqa: BLE001 — queue full or engine dead
            raise engine_error(error) from None


# ----------------------------------------------------------------- output

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite(logprob: float) -> float:
    """JSON has no -inf or NaN; vLLM reports -9999.0 for an impossible token."""
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position, most likely first."""
    top = [(token_id, lp) for token_id, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(top, key=lambda item: item[1].rank)[:k]
