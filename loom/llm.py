"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from loom.default_model import default_model_path
from loom.llm_engine import LLMEngine, PromptType
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class LLM:
    """Generate text from prompts with an engine in this process.

    Keyword arguments follow vLLM: ``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``,
    ``num_gpu_blocks_override``, ``kv_cache_memory_bytes``, ``memory_utilization``,
    ``tensor_parallel_size``, ``seed``, ``tokenizer``, ``chat_template``, ``device``;
    and for worker processes ``distributed_executor_backend`` ("mp" or "uni"),
    ``nnodes``, ``node_rank``, ``master_addr``, ``master_port``,
    ``worker_health_timeout_s`` (see docs/multi_node.md). ``speculative_config`` and
    ``early_stop_config`` take a dict (or JSON text), see docs/speculative_decoding.md:
    ``{"method": "ngram", "num_speculative_tokens": 3}``,
    ``{"enable_early_stop": True, "window_size": 3000, "threshold": 0.99}``. If a worker dies,
    ``generate`` raises ``WorkerDiedError`` and every later call fails at once.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_args(model or default_model_path(), **kwargs)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.render_chat_template(conversation, add_generation_prompt,
                                                  **(chat_template_kwargs or {}))
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        request_ids = []
        try:
            for prompt, sp in zip(prompts, params):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, sp)
                request_ids.append(request_id)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                      dynamic_ncols=True) as progress:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            progress.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r in engine.output_processor.requests])
            raise
        return [results[request_id] for request_id in request_ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()
