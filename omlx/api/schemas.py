"""Request bodies of the OpenAI-compatible routes (pydantic only at the edge).

Unknown fields are accepted and ignored, as OpenAI clients send many; known
fields are range-checked so bad values give a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

# StrictBool: "stream": "yes" is a 400 (as OpenAI answers), not true.
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from omlx.errors import InvalidRequestError
from omlx.template_vars import TemplateVarError, check_template_vars

# Generous next to OpenAI's 4; each stop string is matched against every new token.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Choices per request (``n``): parallel sequences sharing the prompt's prefill.
MAX_CHOICES = 8
# Alternatives per token with logprobs (OpenAI's bound for chat's top_logprobs).
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    # strict: "10" or 10.5 is not an integer, "0.7" not a number, "yes" not a boolean
    # (OpenAI answers 400 too); unknown fields stay accepted.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


StopField = Annotated[str | list[str] | None, Field(default=None)]


def check_stop_strings(stops: list[str]) -> None:
    """Caps on stop strings (raises ValueError: a 400 naming the field)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(
            f"each stop sequence must be at most {MAX_STOP_CHARS} characters (got {longest})"
        )


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
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    # Extension (as in vLLM): keep generating past end-of-sequence, for benchmarks.
    ignore_eos: StrictBool = False
    # Extension: false turns speculative decoding off for this request.
    speculative: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    response_format: dict[str, Any] | None = None
    # Extension (vLLM's name): exactly one of json, regex, grammar (EBNF), choice.
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([value] if isinstance(value, str) else value or [])
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
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "'top_logprobs' needs 'logprobs': true; set logprobs to true or drop top_logprobs",
                param="top_logprobs",
            )
        return self

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token with logprobs (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            check_template_vars(value or {})
        except TemplateVarError as exc:
            # Not a ValueError: pydantic lets it through, so the 400 names the key.
            raise InvalidRequestError(str(exc), param=f"chat_template_kwargs.{exc.key}") from None
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: PromptField
    # 0 with echo: score the prompt only (lm-eval-harness's loglikelihood idiom).
    max_tokens: int | None = Field(default=None, ge=0)
    echo: StrictBool = False
    suffix: str | None = None
    # OpenAI's legacy bound is 5; omlx allows as many as chat's top_logprobs.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "'max_tokens' 0 generates nothing: it is allowed only with 'echo': true "
                "(to score the prompt with logprobs); set max_tokens to at least 1",
                param="max_tokens",
            )
        return self

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
