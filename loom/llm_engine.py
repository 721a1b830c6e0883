"""LLMEngine: input processing, the engine core and output processing in one process.

The offline ``LLM`` drives it step by step. Input processing turns a prompt (text
or token ids) into validated token ids; the engine core schedules and executes;
the output processor turns token ids back into text.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loom.config import EngineConfig
from loom.engine_args import make_engine_config
from loom.core.engine_core import EngineCore
from loom.input_processor import InputProcessor, PromptType
from loom.output_processor import OutputProcessor
from loom.outputs import RequestOutput
from loom.request import Request
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer, load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.experts_across_replicas:
            raise ValueError("expert parallel across data-parallel replicas runs every "
                             "replica together, which `loom serve --data-parallel-size` does; "
                             "the offline engine runs one replica: drop data_parallel_size "
                             "or use tensor_parallel_size with enable_expert_parallel")
        self.config = config
        if config.model.skip_tokenizer_init:
            self.tokenizer: Tokenizer = TokenIdsOnly(config)
        else:
            self.tokenizer = load_tokenizer(config.model.model, config.model.tokenizer,
                                            config.model.chat_template)
        self.input_processor = InputProcessor(config.model, self.tokenizer,
                                              config.structured_outputs,
                                              config.scheduler.policy)
        self.engine_core = EngineCore.from_config(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(make_engine_config(model, **kwargs))

    # ----------------------------------------------------------------- input side

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, validated prompt token ids)."""
        return self.input_processor.process_prompt(prompt)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, stream: bool = False) -> None:
        params = params or SamplingParams(**self.config.model.default_sampling_params)
        text, token_ids, mm_features = self.input_processor.process(prompt)
        self.input_processor.validate_params(params)
        if isinstance(self.tokenizer, TokenIdsOnly):
            self.tokenizer.check_params(params)
        eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        engine_ids = self.output_processor.add_request(request_id, text, token_ids, params, stream)
        try:
            for index, engine_id in enumerate(engine_ids):
                self.engine_core.add_request(Request(
                    engine_id, token_ids, params, eos_token_ids,
                    parent_request_id=request_id, index=index, mm_features=mm_features))
        except BaseException:  # refused (the scheduler's admission checks): forgotten here too
            self.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.engine_core.abort_requests(self.output_processor.abort_request(request_id))

    # ----------------------------------------------------------------- the loop

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        for engine_request_id, stop in processed.stopped_by_string:
            self.engine_core.finish_by_stop_string(engine_request_id, stop)
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class TokenIdsOnly(Tokenizer):
    """The tokenizer under ``skip_tokenizer_init=True``: prompts are token ids, outputs
    carry token ids and empty text. Generation ends at the checkpoint's eos ids
    (generation_config.json, else config.json's ``eos_token_id``), as in vLLM."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(None, _checkpoint_eos_token_ids(config.model.model),
                         name=config.model.model)
        self._vocab_size = config.model.vocab_size or 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def chat_template(self) -> str | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("skip_tokenizer_init=True: give prompts as token ids (a list of ints "
                         "or {'prompt_token_ids': [...]}), not text")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return ""

    def render_chat_template(self, messages, add_generation_prompt=True, tools=None,
                             **kwargs) -> str:
        raise ValueError("skip_tokenizer_init=True: chat needs the tokenizer's chat template; "
                         "render the prompt's token ids yourself and call generate")

    def check_params(self, params: SamplingParams) -> None:
        """What cannot work on token ids alone."""
        if params.stop:
            raise ValueError("skip_tokenizer_init=True: stop strings need the tokenizer; "
                             "use stop_token_ids")
        if params.structured_outputs is not None:
            raise ValueError("skip_tokenizer_init=True: structured outputs need the tokenizer")


def _checkpoint_eos_token_ids(model: str) -> list[int]:
    from loom.model.loader import load_hf_config

    eos: Any = None
    config_path = os.path.join(model, "generation_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(load_hf_config(model), "eos_token_id", None)
    if eos is None:
        return []
    return list(dict.fromkeys(eos if isinstance(eos, list) else [eos]))
