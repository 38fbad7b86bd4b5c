"""Request bodies of the OpenAI-compatible routes (pydantic only at the edge).

Unknown fields are accepted and ignored, as OpenAI clients send many; known
fields are range-checked so bad values give a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


StopField = Annotated[str | list[str] | None, Field(default=None)]


class _Sampling(_Body):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    seed: int | None = None
    stop: StopField
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # Extension (as in vLLM): keep generating past end-of-sequence, for benchmarks.
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool | int | None = None
    response_format: dict[str, Any] | None = None
    # Extension (vLLM's name): exactly one of json, regex, grammar (EBNF), choice.
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    # "auto" | "none" | "required" | {"type": "function", ...}: "none" hides the tools;
    # "required", a named function and strict tools are enforced by a grammar
    # (omlx/api/tool_grammar.py).
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: PromptField
    echo: bool = False
    suffix: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
