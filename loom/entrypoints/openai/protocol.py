"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Bodies are validated straight from JSON in strict mode: a number where a string
belongs, a string where a number belongs, ``NaN`` or ``Infinity`` are all 400s that
name the field. Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo,
                      field_validator)

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
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


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
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool": the call this turn answers


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
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None  # None: up to the context limit
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=_MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
