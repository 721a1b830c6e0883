"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic
models, and how each becomes the engine's ``SamplingParams``.

    body bytes --Model.parse--> request --request.to_sampling_params--> SamplingParams

``parse`` validates straight from JSON in strict mode: a number where a string
belongs, a string where a number belongs, ``NaN`` or ``Infinity`` are all 400s that
name the field. Unknown fields are ignored, as OpenAI and vLLM do. Checks of one
request field against another are validators here, so they fail at the same point
with the same envelope. ``to_sampling_params`` adds what needs the prompt: max_tokens
against the context.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, ValidationInfo, field_validator)

from loom.entrypoints.openai.errors import RequestError
from loom.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

_MAX_N = 128  # OpenAI's limit on n
_MAX_TOP_LOGPROBS = 20
_SEED = Field(default=None, ge=-(2**63), lt=2**64)

TokenId = Annotated[int, Field(ge=0, lt=2**63)]
# Every integer the engine gets travels as a 64-bit msgpack int; larger ones are a 400
# here, not an OverflowError when the request is sent to the engine core.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


# Arguments of transformers' apply_chat_template (and the template's own variables) that
# chat_template_kwargs may not override: a template of the client's, tokenizing, other
# messages or tools. Everything else in it reaches the template as a variable.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _check_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"{reserved[0]!r} cannot be set through chat_template_kwargs "
                         f"(reserved: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})")
    return kwargs


ChatTemplateKwargs = Annotated[dict[str, Any], AfterValidator(_check_template_kwargs)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @classmethod
    def parse(cls, body: bytes) -> Self:
        """The request in ``body``; a RequestError naming the first field at fault.

        The one place a pydantic ValidationError becomes a 400: its ``loc`` is the
        field, and a validator's own ValueError (``ctx["error"]``) is the message."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as error:
            raise _request_error(error.errors(include_url=False)[0]) from None


def _request_error(first: dict[str, Any]) -> RequestError:
    if first["type"] == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first['msg']}")
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "value_error":  # a validator below; its message names the field
        return RequestError(str(first["ctx"]["error"]), param=loc[0] if loc else None)
    if not loc:
        return RequestError(f"the request body must be a JSON object: {first['msg']}")
    if loc[0] == "prompt" and len(loc) > 1 and first["type"] != "missing":
        return RequestError("prompt must be a string, a list of strings, a list of token ids "
                            "or a list of lists of token ids", param="prompt")
    return RequestError(f"{'.'.join(loc)}: {first['msg']}", param=loc[0])


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaResponseFormat(OpenAIModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore",
                              populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsFields(OpenAIModel):
    """vLLM's ``structured_outputs`` extra field: one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class SamplingFields(OpenAIModel):
    """Fields both endpoints share, with OpenAI's defaults; vLLM's extras at the end."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=_MAX_N)
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = _SEED
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    # A reasoning budget: vLLM's thinking_token_budget, FastDeploy's reasoning_max_tokens
    # (-1 unlimited, 0 no thinking); None: the server's --reasoning-budget.
    # vLLM's: under --scheduling-policy priority, lower runs first
    priority: Int64 = 0
    # vLLM's: settings for the server's custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, Any] | None = None
    thinking_token_budget: Int64 | None = Field(default=None, ge=-1)
    reasoning_max_tokens: Int64 | None = Field(default=None, ge=-1)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Prefill/decode disaggregation, vLLM's field (docs/disaggregation.md): set by the router.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or ():
            try:
                int(key)
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") \
                    from None
        return value

    # Where the request and SamplingParams name a field differently: SamplingParams'
    # name -> the request's (for the param of a 400).
    REQUEST_FIELDS: ClassVar[dict[str, str]] = {}
    # The field holding the prompt: the param of a context-length error.
    PROMPT_FIELD: ClassVar[str] = "prompt"

    def thinking_budget(self, effort_budgets: dict[str, int] | None = None) -> int | None:
        """The request's reasoning budget: thinking_token_budget, else reasoning_max_tokens,
        else its reasoning_effort's budget (chat); None: the server's default."""
        if self.thinking_token_budget is not None:
            return self.thinking_token_budget
        if self.reasoning_max_tokens is not None:
            return self.reasoning_max_tokens
        effort = getattr(self, "reasoning_effort", None)
        return (effort_budgets or {}).get(effort) if effort else None

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                           defaults: dict[str, Any],
                           structured_outputs: StructuredOutputsParams | None,
                           max_logprobs: int = 20,
                           effort_budgets: dict[str, int] | None = None) -> SamplingParams:
        """The SamplingParams of one prompt of this request (of ``num_prompt_tokens``
        tokens, rendered from the messages for a chat); logprobs beyond the server's
        ``max_logprobs`` are a 400 naming the request's field."""
        requested, logprobs, fields = self._endpoint_fields()
        max_tokens = self._max_tokens(requested, num_prompt_tokens, max_model_len,
                                      defaults.get("max_tokens"))
        params = self._sampling_params(max_tokens, logprobs, defaults, structured_outputs,
                                       thinking_token_budget=self.thinking_budget(
                                           effort_budgets), **fields)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                field = self.REQUEST_FIELDS.get(name, name)
                raise RequestError(f"{field} must be at most {max_logprobs} (the server's "
                                   f"--max-logprobs), got {value}", param=field)
        return params

    def _endpoint_fields(self) -> tuple[int | None, int | None, dict[str, Any]]:
        """What the endpoint calls them: (max_tokens asked for, SamplingParams.logprobs,
        further SamplingParams fields)."""
        raise NotImplementedError

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, max_model_len: int,
                    default: int | None) -> int:
        """max_tokens, defaulting to what the context leaves (at most ``default``, the
        generation config's max_new_tokens); a 400 when prompt and completion do not
        fit. (A max_tokens under 1 is SamplingParams' own check.)"""
        if requested is None:
            return min(max_model_len - num_prompt_tokens, default or max_model_len)
        if requested >= 1 and num_prompt_tokens + requested > max_model_len:
            prompt = self.PROMPT_FIELD
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                f"{prompt}, {requested} in the completion). Please reduce the length of the "
                f"{prompt} or of max_tokens.", param=prompt, code="context_length_exceeded")
        return requested

    def _sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict[str, Any],
                         structured_outputs: StructuredOutputsParams | None,
                         **fields: Any) -> SamplingParams:
        """The SamplingParams of this request. A sampling field the request leaves out
        takes ``defaults`` (the model's generation config,
        ``ModelConfig.default_sampling_params``), then loom's own default."""

        def value(name: str, fallback: Any) -> Any:
            given = getattr(self, name)
            return given if given is not None else defaults.get(name, fallback)

        logit_bias = ({int(token_id): bias for token_id, bias in self.logit_bias.items()}
                      if self.logit_bias else None)
        try:
            return SamplingParams(
                n=self.n,
                temperature=value("temperature", 1.0),
                top_p=value("top_p", 1.0),
                top_k=value("top_k", 0),
                min_p=value("min_p", 0.0),
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=value("repetition_penalty", 1.0),
                max_tokens=max_tokens, min_tokens=self.min_tokens,
                stop=self.stop or [], stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs, logit_bias=logit_bias, bad_words=self.bad_words,
                priority=self.priority, extra_args=self.vllm_xargs,
                allowed_token_ids=self.allowed_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured_outputs,
                kv_transfer_params=self.kv_transfer_params, **fields)
        except SamplingParamsError as error:  # the field, in the request's name for it
            field = self.REQUEST_FIELDS.get(error.field, error.field)
            raise RequestError(f"{field} {error.problem}", param=field) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    # vLLM's beam search: n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0

    REQUEST_FIELDS: ClassVar[dict[str, str]] = {"prompt_logprobs": "logprobs"}

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return value

    def _endpoint_fields(self) -> tuple[int | None, int | None, dict[str, Any]]:
        # With echo, the echoed prompt's tokens carry logprobs too (the first one None).
        echoed = ({"prompt_logprobs": self.logprobs}
                  if self.echo and self.logprobs is not None else {})
        return self.max_tokens, self.logprobs, echoed


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    # data:image/...;base64,...; http(s) from --allowed-media-domains; a file under
    # --allowed-local-media-path (loom/multimodal/media.py)
    url: str
    detail: str | None = None  # OpenAI's auto, low, high: accepted; the processor sizes images


class ImageURLContentPart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(OpenAIModel):
    # data:video/...;base64,... (MP4/MOV, WebM/Matroska, AVI); http(s) and files as images
    url: str


class VideoURLContentPart(OpenAIModel):
    """vLLM's video part: a video file, sampled to frames (loom/multimodal/media.py)."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextContentPart | ImageURLContentPart | VideoURLContentPart,
                        Field(discriminator="type")]


class FunctionCall(OpenAIModel):
    name: str
    # A JSON string from OpenAI's clients; the chat template gets the object it encodes.
    arguments: str | dict[str, Any] | None = None


class AssistantToolCall(OpenAIModel):
    """A call in an earlier assistant turn, sent back by the client with the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """A turn of the conversation. Content may be null or missing (an assistant turn that
    only calls tools); other fields a template may read pass through."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool": the call this turn answers


_PART_SHAPES = ('{"type": "text", "text": ...}, {"type": "image_url", "image_url": '
                '{"url": ...}} or {"type": "video_url", "video_url": {"url": ...}}')


def _check_content_parts(messages: Any) -> Any:
    """A content part of a type loom does not take, or an image_url or video_url that is
    not an object with a url, is a 400 naming the part (pydantic's own message would name
    a branch of the content's union instead)."""
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for number, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            media = part.get(kind) if kind in ("image_url", "video_url") else None
            if not ((kind == "text" and isinstance(part.get("text"), str))
                    or (isinstance(media, dict) and isinstance(media.get("url"), str))):
                raise ValueError(f"messages.{index}.content.{number}: a content part is "
                                 f"{_PART_SHAPES}; got {_shown(part)}")
    return messages


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float)) else repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


ChatMessages = Annotated[list[ChatMessage], BeforeValidator(_check_content_parts),
                         Field(min_length=1)]


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: ChatMessages
    max_tokens: Int64 | None = None  # None: up to the context limit
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=_MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's: a reasoning budget by name (the server's --reasoning-effort-budgets)
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    REQUEST_FIELDS: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}
    PROMPT_FIELD: ClassVar[str] = "messages"

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def _endpoint_fields(self) -> tuple[int | None, int | None, dict[str, Any]]:
        requested = (self.max_completion_tokens if self.max_completion_tokens is not None
                     else self.max_tokens)
        return requested, (self.top_logprobs or 0) if self.logprobs else None, {}
