"""One Responses API turn on the request pipeline: the conversation (a stored one
first), truncation, the response object it echoes, and storing it when done."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from omlx.api.encoder import Encoder
from omlx.api.hosted_tools import dropped_header
from omlx.api.images import ImageSink
from omlx.api.pipeline import Call, Prepared, Rendering
from omlx.api.prompts import RenderedPrompt, SamplingRequest
from omlx.api.responses_format import Echo, Event, ResponseFormat
from omlx.api.responses_input import (
    DeclaredTools,
    Item,
    chat_messages,
    chat_tools,
    input_items,
    one_constraint,
    output_spec,
    reasoning_template_vars,
    tool_rule,
)
from omlx.api.responses_schemas import ResponsesRequest
from omlx.api.responses_store import ResponseStore, StoredResponse
from omlx.api.sse import KEEPALIVE, sse_named
from omlx.engine.stream import StreamEvent
from omlx.errors import InvalidRequestError, OmlxError
from omlx.scheduler import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ResponsesTurn:
    """A checked request: the conversation to render and how output is constrained."""

    body: ResponsesRequest
    history: list[Item]  # the stored conversation it continues
    allowlist: tuple[str, ...]  # image URL hosts
    items: list[Item] = field(init=False)
    declared: DeclaredTools = field(init=False)
    tools: list[dict[str, Any]] | None = field(init=False)  # Chat-shaped
    # The conversation the prompt was rendered from (truncation drops the oldest).
    conversation: list[Item] = field(init=False)

    def __post_init__(self) -> None:
        body = self.body
        if body.background:
            raise InvalidRequestError(
                "background responses are not supported; send background: false (the default)",
                param="background",
            )
        self.items = input_items(body.input)
        self.declared = chat_tools(body.tools)
        self.tools = self.declared.chat
        if not self.history and not self.items:
            raise InvalidRequestError("'input' must not be empty", param="input")
        self.conversation = [*self.history, *self.items]

    def call(self) -> Call:
        body = self.body
        rule = tool_rule(self.tools, body.tool_choice, body.parallel_tool_calls)
        hint = "; or send truncation: 'auto' to drop the oldest input items"
        hint = "" if body.truncates else hint
        return Call(
            model=body.model,
            kind="responses",
            id_prefix="resp_",
            tools=self.tools if body.tool_choice != "none" else None,
            template_kwargs=reasoning_template_vars(body.reasoning),
            sampling=SamplingRequest(
                max_tokens=body.max_output_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                max_tokens_param="max_output_tokens",
                prompt_param="input",
                hint=hint,
                speculative=body.speculative,
            ),
            spec=one_constraint(output_spec(body.text), rule),
            stream=body.stream is True,
            prompts=self.prompts,
            headers=dropped_header(self.declared.dropped),
        )

    async def prompts(self, rendering: Rendering) -> list[RenderedPrompt]:
        """The rendered prompt; with truncation "auto", the oldest items are dropped until
        the prompt and max_output_tokens fit the context window."""
        engine, body = rendering.engine, self.body
        names = {item["id"]: f"input[{i}]" for i, item in enumerate(self.items)}
        tools = self.tools if body.tool_choice != "none" else None
        room = body.max_output_tokens or 1
        conversation = [*self.history, *self.items]
        while True:
            images = ImageSink(self.allowlist) if engine.loaded.vision is not None else None
            messages = chat_messages(body.instructions, conversation, images, names)
            prompt = await rendering.chat(messages, tools, images)
            excess = len(prompt.ids) + room - engine.context_window
            if excess <= 0 or not body.truncates or len(conversation) <= 1:
                self.conversation = conversation
                return [prompt]
            # Drop in proportion to the excess: a few renders for a long history, not one per item.
            num_drop = max(1, len(conversation) * excess // max(1, len(prompt.ids)))
            conversation = _without_oldest(conversation, min(num_drop, len(conversation) - 1))

    def echo(self, model: str, params: SamplingParams) -> Echo:
        body = self.body
        text_format = (body.text.format if body.text else None) or {"type": "text"}
        return Echo(
            model=model,
            instructions=body.instructions,
            tools=body.tools or [],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            text_format=text_format,
            reasoning_effort=body.reasoning.effort if body.reasoning else None,
            max_output_tokens=body.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            truncation=body.truncation or "disabled",
            metadata=body.metadata or {},
            store=body.stores,
            previous_response_id=body.previous_response_id,
        )


def _without_oldest(items: list[Item], num_drop: int) -> list[Item]:
    """``items`` less the first ``num_drop``, then up to the next user message: the
    conversation starts with a user turn (templates that check roles want one), never
    with a tool output cut from its call."""
    rest = items[num_drop:]
    while len(rest) > 1 and not (rest[0]["type"] == "message" and rest[0]["role"] == "user"):
        rest = rest[1:]
    return rest


class ResponseEncoder(Encoder):
    """A response on the wire: named SSE events, the response stored (with ``store``)
    before the client sees response.completed."""

    def __init__(self, fmt: ResponseFormat, store: ResponseStore, kept: list[Item] | None):
        self.fmt = fmt
        self.store = store
        self.kept = kept  # the conversation to store with the response (None: not stored)

    @classmethod
    def of(cls, turn: ResponsesTurn, store: ResponseStore, prepared: Prepared) -> ResponseEncoder:
        echo = turn.echo(prepared.model, prepared.params[0])
        fmt = ResponseFormat(prepared.request_id, echo, prepared.parser(), turn.declared.namespaced)
        return cls(fmt, store, turn.conversation if turn.body.stores else None)

    def opening(self) -> list[str]:
        return _events(self.fmt.start())

    def frames(self, index: int, event: StreamEvent) -> list[str]:
        return _events(self.fmt.add(event))

    def error_frames(self, error: OmlxError) -> list[str]:
        return _events(self.fmt.fail(error))

    def keepalive(self) -> str | None:
        return KEEPALIVE

    def body(self) -> dict[str, Any]:
        return self.fmt.body()

    async def finished(self) -> None:
        if self.kept is None:
            return
        try:
            await asyncio.to_thread(self.store.put, StoredResponse(self.fmt.body(), self.kept))
        except sqlite3.Error as exc:  # a full disk must not lose the answer being sent
            log.error("could not store response %s: %s", self.fmt.response_id, exc)


def _events(events: list[Event]) -> list[str]:
    return [sse_named(event["type"], event) for event in events]
