"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

    /tokenize    {"prompt": "..."}              -> {"count", "max_model_len", "tokens", "token_strs"?}
                 {"messages": [...], ...}       -> the same, for the chat prompt /v1/chat/completions
                                                   would build (same template, same rendering,
                                                   each image's placeholder expanded into the
                                                   image's tokens)
    /detokenize  {"tokens": [ids]}              -> {"prompt": "..."}

A prompt longer than the context is still counted (clients use /tokenize to find out
whether it fits); only token ids the tokenizer does not have are a 400.
"""

from __future__ import annotations

import json

from pydantic import model_validator
from starlette.responses import JSONResponse, Response

from loom.entrypoints.chat_images import ChatMedia
from loom.entrypoints.openai.errors import RequestError
from loom.entrypoints.openai.protocol import (ChatMessages, ChatTemplateKwargs, ChatTool,
                                             OpenAIModel, TokenId)
from loom.entrypoints.openai.serving_chat import chat_images, render_chat_prompt
from loom.entrypoints.openai.serving_engine import OpenAIServing


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: ChatMessages
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    # The chat template writes BOS itself; True would add a second one.
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None

    @model_validator(mode="after")
    def _one_way_to_end(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true; set add_generation_prompt to false")
        return self


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):
    """Needs only the engine's tokenizer, never its core."""

    async def tokenize(self, body: bytes) -> Response:
        request = _tokenize_request_type(body).parse(body)
        self.check_model(request.model)
        tokenizer = self.engine.tokenizer
        images: list[ChatMedia] = []
        if isinstance(request, TokenizeChatRequest):
            template_kwargs = dict(request.chat_template_kwargs or {})
            template_kwargs["continue_final_message"] = request.continue_final_message
            if request.chat_template is not None:
                template_kwargs["chat_template"] = request.chat_template
            images = chat_images(request.messages)
            if images:
                self.check_images(images)
            text = render_chat_prompt(tokenizer, request.messages, request.tools,
                                      request.add_generation_prompt, template_kwargs)
        else:
            text = request.prompt
        token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        if images:
            token_ids, _ = await self.apply_images(token_ids, images)
        token_strs = (tokenizer.hf.convert_ids_to_tokens(token_ids)
                      if request.return_token_strs else None)
        return JSONResponse(TokenizeResponse(
            count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids,
            token_strs=token_strs).model_dump())

    def detokenize(self, body: bytes) -> Response:
        request = DetokenizeRequest.parse(body)
        self.check_model(request.model)
        tokenizer = self.engine.tokenizer
        vocab_size = tokenizer.vocab_size
        for position, token_id in enumerate(request.tokens):
            if token_id >= vocab_size:
                raise RequestError(f"tokens[{position}] = {token_id} is outside the vocabulary "
                                   f"[0, {vocab_size})", param="tokens")
        text = tokenizer.decode(request.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _tokenize_request_type(body: bytes) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """vLLM's TokenizeRequest is a union told apart by its fields: "messages" means chat."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return TokenizeCompletionRequest  # whose parse names the JSON error
    if isinstance(fields, dict) and "messages" in fields and "prompt" not in fields:
        return TokenizeChatRequest
    return TokenizeCompletionRequest
