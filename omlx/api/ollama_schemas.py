"""Request bodies of the Ollama-compatible routes (pydantic only at the edge).

Types are strict, as Ollama's Go decoder is: ``"stream": "yes"`` or
``"temperature": "0.5"`` is a 400 naming the field. Unknown fields and unknown
``options`` keys are accepted and ignored, as Ollama does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, field_validator

from omlx.api.schemas import check_stop_strings
from omlx.errors import InvalidRequestError

StrictFloat = Annotated[float, Strict()]  # an int is a float too; a string is not
# A duration: "5m", "1h30m", "-1"; or a number of seconds. Negative: keep loaded.
KeepAlive = Annotated[float, Strict()] | str


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Options(_Body):
    """The ``options`` Ollama maps to its runner; the sampling ones are honoured."""

    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=10.0)
    seed: StrictInt | None = None
    # -1: no limit (the context window), -2: fill the context (the same here).
    num_predict: StrictInt | None = Field(default=None, ge=-2)
    # 0: the model's window, as not sending it.
    num_ctx: StrictInt | None = Field(default=None, ge=0)
    stop: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, value: list[str] | None) -> list[str] | None:
        check_stop_strings(value or [])
        return value


class ModelRequest(_Body):
    """Bodies that name one model (show, delete); old clients send ``name``."""

    model: str | None = None
    name: str | None = None

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise InvalidRequestError("'model' is required", param="model")
        return name


class ToolCallFunction(_Body):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(_Body):
    function: ToolCallFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # null is "", as Go decodes it
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None


# true / false, or an effort level for models that take one (gpt-oss).
Think = StrictBool | Literal["low", "medium", "high"]


class _Generation(_Body):
    model: str = Field(min_length=1)
    # "json", or a JSON schema object; "" is no format.
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: StrictBool = True  # Ollama streams unless told not to
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    # Extension: false turns speculative decoding off for this request.
    speculative: StrictBool = True


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    # Extension (Ollama has none): OpenAI's tool_choice, so an agent can force a call;
    # "required" and a named function are enforced by a grammar, "none" hides the tools.
    tool_choice: str | dict[str, Any] | None = None


class GenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: StrictBool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None
