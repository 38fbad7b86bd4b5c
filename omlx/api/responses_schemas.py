"""Request body of the OpenAI Responses API (pydantic only at the edge).

Unknown fields are accepted and ignored (clients such as the Agents SDK send
many); known fields are strict so a bad value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

# OpenAI's limits on metadata.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
TOOL_CHOICE_OPTIONS = ("auto", "none", "required")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Accepted for compatibility; the reasoning text is returned whole, not summarised.
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(_Body):
    # {"type": "text" | "json_object" | "json_schema", ...}: checked in responses_input.
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    model: StrictStr = Field(min_length=1)
    # str | list of items (checked in responses_input); Any so a wrong type is one
    # error naming the field rather than one per member of a union.
    input: Any = Field(default_factory=list)
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": ...}
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # Strict numbers too: "0.5" or true is a 400, not coerced.
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, StrictStr] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    stream: StrictBool | None = None
    background: StrictBool | None = None
    # Extension: false turns speculative decoding off for this request.
    speculative: StrictBool = True

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: Any) -> str | list[dict[str, Any]]:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, dict) for item in value):
            return value
        raise ValueError("must be a string or a list of input items (objects)")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> str | dict[str, Any] | None:
        if value is None or isinstance(value, dict):
            return value
        if isinstance(value, str) and value in TOOL_CHOICE_OPTIONS:
            return value
        raise ValueError(
            "must be 'auto', 'none', 'required' or an object such as "
            '{"type": "function", "name": ...}'
        )

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys (got {len(value)})")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"key '{key[:20]}...' is over {MAX_METADATA_KEY_CHARS} chars")
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"the value of '{key}' is over {MAX_METADATA_VALUE_CHARS} chars")
        return value

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def truncates(self) -> bool:
        return self.truncation == "auto"
