"""Request bodies of the Anthropic Messages API (pydantic only at the edge).

Unknown fields are accepted and ignored, as clients send beta fields we do not
know; known fields are range-checked so bad values give a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

# StrictBool: "stream": "yes" is a 400 (as OpenAI answers), not true.
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from omlx.api.schemas import MAX_STOP_STRINGS, check_stop_strings


class _Body(BaseModel):
    # strict: "10" or 10.5 is not an integer, "0.7" not a number, "yes" not a boolean
    # (OpenAI answers 400 too); unknown fields stay accepted.
    model_config = ConfigDict(extra="allow", strict=True)


class AnthropicMessage(_Body):
    # "system" (not in Anthropic's API, but clients send it): joins the system prompt.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    # Absent or "custom" for client tools; server tools ("web_search_...") are refused.
    type: str | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputConfig(_Body):
    format: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    """What decides the prompt: the Messages body without the sampling fields."""

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    # Structured output: {"format": {"type": "json_schema", "schema": {...}}}, and
    # the earlier beta spelling output_format={"type": "json_schema", ...}.
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None
    # Extension (as on the OpenAI routes): exactly one of json, regex, grammar, choice.
    structured_outputs: dict[str, Any] | None = None
    # Extension: false turns speculative decoding off for this request.
    speculative: StrictBool = True

    @field_validator("stop_sequences")
    @classmethod
    def _stop_caps(cls, value: list[str] | None) -> list[str] | None:
        check_stop_strings(value or [])
        return value
