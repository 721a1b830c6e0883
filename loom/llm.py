"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from loom.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from loom.default_model import default_model_path
from loom.engine_args import EngineArgs, llm_kwargs_to_fields
from loom.entrypoints.chat_images import by_modality, load_chat_media, media_policy, take_images
from loom.errors import WorkerDiedError
from loom.llm_engine import LLMEngine, PromptType
from loom.lora import LoRARequest
from loom.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                          EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                          ScoringRequestOutput)
from loom.pooling import cross_encoder_pair, score_pairs, score_prompt
from loom.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


class LLM:
    """Generate text from prompts with an engine in this process.

    Keyword arguments are the fields of ``EngineArgs`` (loom/engine_args.py, where each
    is documented with its flag), in vLLM's names: ``dtype``, ``max_model_len``,
    ``max_num_seqs``, ``tensor_parallel_size``, ``quantization``, ``speculative_config``
    (a dict or its JSON) ...; vLLM's ``gpu_memory_utilization`` is ``memory_utilization``,
    and ``skip_tokenizer_init`` takes token ids in and gives token ids out. vLLM arguments
    for features loom does not have are accepted at their neutral values only
    (``revision=None``, ``pipeline_parallel_size=1``); ``trust_remote_code`` and
    ``disable_log_stats`` change nothing (loom runs no checkpoint code). Any other name
    is a ``TypeError`` that suggests the closest valid one. If a worker dies,
    ``generate`` raises ``WorkerDiedError`` and every later call fails at once.

    With worker processes (``tensor_parallel_size`` > 1), a script must create the
    ``LLM`` under ``if __name__ == "__main__":``: the workers re-import the script.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        _check_not_importing_main()
        try:
            engine_args = EngineArgs.from_llm_kwargs(model or default_model_path(), kwargs)
            self.engine = LLMEngine(engine_args.create_engine_config())
        except WorkerDiedError as error:
            if error.exitcode == _MISSING_MAIN_GUARD_EXIT_CODE:
                raise RuntimeError(_MISSING_MAIN_GUARD) from None
            raise
        self._request_counter = itertools.count()
        # LoRA adapters served on the ranks, by name (loom/lora.py): the path each was
        # last loaded from and that load's id (SamplingParams.lora_id: its prefix blocks)
        self._loras = {name: (path, 0) for name, path in self.engine.config.model.lora_modules}
        self._lora_loads = itertools.count(1)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An ``LLM`` from arguments already gathered (a command's flags)."""
        kwargs = {spec.name: getattr(engine_args, spec.name)
                  for spec in dataclasses.fields(engine_args)}
        return cls(kwargs.pop("model"), **kwargs)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The Hugging Face tokenizer, as vLLM's ``LLM.get_tokenizer`` returns it."""
        if self.engine.config.model.skip_tokenizer_init:
            raise ValueError("this LLM was made with skip_tokenizer_init=True; it has no "
                             "tokenizer")
        return self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no SamplingParams: the
        checkpoint's generation_config.json sampling values (``generation_config="auto"``,
        the default) over loom's defaults."""
        return SamplingParams(**self.engine.config.model.default_sampling_params)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. ``priority``: one per prompt, as
        vLLM's (lower runs first; needs ``scheduling_policy="priority"``).
        ``lora_request``: the LoRA adapter to run with (one, or one per prompt; None the
        base; needs ``enable_lora``), loaded on first use."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; "
                                 "give one per prompt")
            params = [p.clone(priority=value) for p, value in zip(params, priority)]
        if lora_request is not None:
            loras = ([lora_request] * len(prompts) if isinstance(lora_request, LoRARequest)
                     else list(lora_request))
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
            params = [p if lora is None else p.clone(lora_name=lora.lora_name,
                                                     lora_id=self._lora_id(lora))
                      for p, lora in zip(params, loras)]
        return self._run(prompts, params, use_tqdm)

    def _lora_id(self, lora: LoRARequest) -> int:
        """``lora``'s adapter served on every rank (loaded now if its name is new or its
        path is not the one loaded); the id of that load."""
        if not self.engine.config.model.enable_lora:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        loaded = self._loras.get(lora.lora_name)
        if loaded is None or loaded[0] != lora.lora_path:
            self.collective_rpc("add_lora", (lora.lora_name, lora.lora_path))
            loaded = self._loras[lora.lora_name] = (lora.lora_path, next(self._lora_loads))
        return loaded[1]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (an engine started with
        ``task="embed"``; loom/pooling.py). ``pooling_params``: ``normalize``,
        ``dimensions``. ``truncate_prompt_tokens``: keep the prompt's last this many
        tokens."""
        prompts = _prompt_list(prompts)
        params = _pooling_sampling_params(pooling_params or PoolingParams(), "embed")
        outputs = self._run([_truncated(self, p, truncate_prompt_tokens) for p in prompts],
                            [params] * len(prompts), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(o.pooled or []), o.finished)
                for o in outputs]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities, in input order (an engine started with
        ``task="classify"`` on a ``*ForSequenceClassification`` checkpoint)."""
        prompts = _prompt_list(prompts)
        params = _pooling_sampling_params(PoolingParams(task="classify"), "classify")
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.pooled or []), o.finished)
                for o in outputs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """How well each ``text_2`` answers ``text_1`` (one query against many documents,
        or pairs one to one) (an engine started with ``task="score"``: a decoder
        reranker's yes probability, in [0, 1]; a cross-encoder's logit through its
        activation, sigmoid unless the checkpoint says otherwise; loom/pooling.py)."""
        pairs = score_pairs(text_1, text_2)
        pooler = self.engine.config.model.pooler
        if self.engine.config.model.task != "score":
            raise ValueError("score needs an engine started with task='score' (this one "
                             f"runs task={self.engine.config.model.task!r})")
        if pooler.cross_encoder:  # each pair encoded by the tokenizer, with its token types
            encoded = [cross_encoder_pair(self.get_tokenizer(), query, document)
                       for query, document in pairs]
            prompts: list[PromptType] = [{"prompt_token_ids": ids} for ids, _ in encoded]
            params = [_pooling_sampling_params(PoolingParams(task="score", token_type_start=start),
                                               "score") for _, start in encoded]
        else:
            prompts = [score_prompt(pooler, query, document) for query, document in pairs]
            params = [_pooling_sampling_params(PoolingParams(task="score"), "score")] * len(pairs)
        outputs = self._run(prompts, params, use_tqdm)
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                     ScoringOutput((o.pooled or [float("nan")])[0]), o.finished)
                for o in outputs]

    def beam_search(self, prompts: Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: ``params.beam_width`` best sequences per prompt,
        best first, by cumulative logprob over length ** length_penalty (loom/beam_search.py).
        Each sequence's ``tokens`` hold the prompt's then the generated ones, ``text`` the
        generated text."""
        mode = self.engine.config.model.logprobs_mode
        if not mode.endswith("logprobs"):
            raise ValueError(f"beam search ranks by logprobs; this engine reports {mode} "
                             "(--logprobs-mode raw_logprobs or processed_logprobs)")
        token_ids = [self.engine.process_prompt(prompt)[1] for prompt in prompts]

        def step(sequences: list[list[int]], ask: SamplingParams) -> list[list[tuple[int, float]]]:
            outputs = self.generate([{"prompt_token_ids": tokens} for tokens in sequences],
                                    ask, use_tqdm=False)
            return [sorted(((token_id, entry.logprob) for token_id, entry
                            in output.outputs[0].logprobs[0].items()),
                           key=lambda item: item[1], reverse=True)
                    for output in outputs]

        eos = frozenset(self.engine.tokenizer.eos_token_ids)
        results = beam_search(token_ids, params, step, eos)
        for prompt, result in zip(token_ids, results):
            for sequence in result.sequences:
                sequence.text = self.engine.tokenizer.decode(sequence.tokens[len(prompt):])
        return results

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template.

        A multimodal model takes images in the messages' content, beside text parts:
        ``{"type": "image_url", "image_url": {"url": ...}}`` (a data: URL; http(s) from
        ``allowed_media_domains``; a file under ``allowed_local_media_path``),
        ``{"type": "image_pil", "image_pil": image}`` or ``{"type": "image", "image":
        image}`` (a PIL image); and videos where the model takes them: ``{"type":
        "video_url", "video_url": {"url": ...}}`` (a video file, sampled to frames)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        policy = media_policy(self.engine.config.model)
        prompts = []
        for conversation in conversations:
            conversation, items = take_images(conversation)
            if items:  # a text-only model, too many images: before any is loaded
                self.engine.input_processor.check_media_counts(
                    {modality: len(group) for modality, group in by_modality(items).items()},
                    "messages")
            text = tokenizer.render_chat_template(conversation, add_generation_prompt,
                                                  **(chat_template_kwargs or {}))
            prompt = {"prompt": text,
                      "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            if items:
                prompt["multi_modal_data"] = {
                    modality: [load_chat_media(item, policy) for item in group]
                    for modality, group in by_modality(items).items()}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    # ----------------------------------------------------------------- weights that change
    # As vLLM's and SGLang's offline engines have them for RL loops (docs/weight_updates.md).
    # Between generate calls; each runs on every rank and empties the prefix cache.

    def update_weights(self, path: str | None = None,
                       lora_name: str | None = None) -> dict[str, Any]:
        """Load new weights of the same architecture and shapes from ``path``: a checkpoint
        directory of safetensors, a .gguf file, or an ipc manifest written by
        ``loom.weight_sync.WeightPublisher`` (None: reload the last checkpoint). Each rank
        takes its shard through its parameters' ``weight_loader``s. A missing file or a
        tensor that does not fit raises ValueError or FileNotFoundError naming it, and
        the weights stay as they were. Returns ``{"num_parameters", "seconds"}``.

        ``lora_name``: new weights for that LoRA adapter (served already) from the PEFT
        directory ``path``, the base and the other adapters untouched, the prefix cache
        kept (the adapter's later requests have a load id of their own, so its old blocks
        are not reused); a ``LoRARequest`` of that name with ``path`` runs the new
        weights. Returns ``{"lora_name", "seconds"}``."""
        if lora_name is None:
            return self.engine.engine_core.update_weights(path)
        if lora_name not in self._loras:
            raise ValueError(f"no LoRA adapter {lora_name!r} is served (served: "
                             f"{', '.join(sorted(self._loras)) or 'none'}); load it with a "
                             "LoRARequest first")
        result = self.engine.engine_core.update_weights(path, lora_name)
        self._loras[lora_name] = (path, next(self._lora_loads))
        return result

    def update_weights_from_tensors(self, named_tensors) -> dict[str, Any]:
        """Load (checkpoint name, tensor) pairs, any subset of the weights, e.g. from a
        trainer in this process. Worker processes (TP > 1) map them from one
        shared-memory segment."""
        from loom.weight_sync import WeightPublisher

        tensors = list(named_tensors)
        core = self.engine.engine_core
        if not self.engine.config.parallel.use_worker_processes:
            return core.update_weights_from_tensors(tensors)
        with WeightPublisher() as publisher:
            return core.update_weights(publisher.publish(tensors, partial=True))

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV cache (level 1: weights kept) or the KV cache and the weights
        (level 2: ``wake_up`` reloads them from the last checkpoint loaded, so weights
        given as tensors since are lost, as in vLLM). The prefix cache is emptied.
        ``generate`` raises until ``wake_up``."""
        return self.engine.engine_core.sleep(level)

    def wake_up(self) -> dict[str, Any]:
        return self.engine.engine_core.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.engine_core.sleep_level > 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests hold blocks."""
        return self.engine.engine_core.reset_prefix_cache()

    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)`` on every rank (loom/worker/worker.py), each
        rank's result in rank order; across processes the arguments and results are
        msgpack values."""
        return self.engine.engine_core.collective_rpc(method, args, kwargs)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        if engine.engine_core.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {engine.engine_core.sleep_level}); "
                               "call wake_up() (or update_weights) before generate")
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


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _pooling_sampling_params(pooling: PoolingParams, task: str) -> SamplingParams:
    if pooling.task != task:
        pooling = msgspec.structs.replace(pooling, task=task)
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)


def _truncated(llm: LLM, prompt: PromptType, keep: int | None) -> PromptType:
    """``prompt`` as its last ``keep`` tokens (None: as it is)."""
    if keep is None:
        return prompt
    _, token_ids = llm.engine.process_prompt(prompt)
    return {"prompt_token_ids": token_ids[-keep:]}


def llm_kwargs_to_engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)`` -> ``EngineArgs`` fields; an unknown name is a TypeError naming
    the closest valid ones, as a misspelt argument is in Python."""
    return llm_kwargs_to_fields(kwargs)


_MISSING_MAIN_GUARD = (
    "a worker process re-imported the main script and it created an LLM again; create the "
    "LLM under `if __name__ == \"__main__\":` in your script (worker processes start with "
    "multiprocessing's spawn, which re-imports it)")
# How such a worker exits, so that the LLM being built in the parent can say why.
_MISSING_MAIN_GUARD_EXIT_CODE = 3


def _check_not_importing_main() -> None:
    """Worker processes start with ``spawn``, which re-imports the main script; a script
    that makes an ``LLM`` at import time would make one again in every worker. Python
    marks that re-import (``_inheriting``, the flag its own check reads): stop there,
    with one line naming the fix and no traceback."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"loom: error: {_MISSING_MAIN_GUARD}", file=sys.stderr, flush=True)
        raise SystemExit(_MISSING_MAIN_GUARD_EXIT_CODE)
