"""Anthropic Messages API <-> our chat pipeline.

Requests become OpenAI-style messages and tools for ``render_chat`` (the chat
templates speak that shape); engine events become Messages content blocks and
the named stream events (message_start, content_block_*, message_delta...).
"""

from __future__ import annotations

import json
from typing import Any

from omlx.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from omlx.api.encoder import Encoder
from omlx.api.errors import anthropic_error_body
from omlx.api.hosted_tools import is_anthropic_server_tool
from omlx.api.images import ImagePart, ImageSink, from_base64, from_data_url
from omlx.api.output_parser import OutputParser, ParsedDelta, ToolCall
from omlx.api.prompts import SamplingRequest
from omlx.api.sse import sse_named
from omlx.api.structured import extension_spec
from omlx.api.tool_grammar import combined
from omlx.api.tool_grammar import tool_constraint as tool_constraint_of
from omlx.engine.stream import StreamEvent
from omlx.errors import InvalidRequestError, OmlxError
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import Mode, ToolConstraint

Frame = tuple[str, dict[str, Any]]  # (SSE event name, data)
PING: Frame = ("ping", {"type": "ping"})
_SCHEMA_PARAM = "tools[{i}].input_schema"


# ---- request -> chat template input ------------------------------------------------


def chat_messages(
    body: CountTokensRequest, images: ImageSink | None = None
) -> list[dict[str, Any]]:
    """OpenAI-style messages: system first, tool_use -> tool_calls, tool_result -> tool.

    ``system`` messages among ``messages`` join the top-level system prompt, in order
    (chat templates take one system prompt, at the start). ``images``: where a user
    message's ``image`` blocks go (None: they are refused)."""
    systems = [_system_text(body.system)]
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(body.messages):
        blocks = _blocks(msg.content)
        if msg.role == "system":
            systems.append(_system_text(blocks, f"messages[{i}].content"))
        elif msg.role == "user":
            messages.extend(_user_messages(blocks, i, images))
        else:
            messages.append(_assistant_message(blocks, i))
    system = "\n".join(text for text in systems if text)
    return [{"role": "system", "content": system}, *messages] if system else messages


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _system_text(system: str | list[dict[str, Any]] | None, param: str = "system") -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(_text_of(block, f"{param}[{j}]") for j, block in enumerate(system))


def uses_cache_control(body: CountTokensRequest) -> bool:
    """Whether any block asks for prompt caching (``cache_control`` on a system,
    message or tool block, or on the request): then usage reports cache writes."""
    blocks: list[Any] = [body.model_extra or {}]
    blocks += body.system if isinstance(body.system, list) else []
    blocks += [tool.model_extra or {} for tool in body.tools or []]
    for msg in body.messages:
        for block in msg.content if isinstance(msg.content, list) else []:
            nested = block.get("content")  # a tool_result's own blocks
            blocks += [block, *(nested if isinstance(nested, list) else [])]
    return any(isinstance(b, dict) and b.get("cache_control") is not None for b in blocks)


def _text_of(block: dict[str, Any], param: str) -> str:
    if block.get("type") != "text":
        _refuse(block.get("type"), param)
    return str(block.get("text", ""))


def _refuse(kind: Any, param: str) -> None:
    if kind in ("image", "document"):
        message = f"{param}: {kind} content is not supported by this server; send text only"
    else:
        message = f"{param}: content block type '{kind}' is not supported here"
    raise InvalidRequestError(message, param=param)


def _user_messages(
    blocks: list[dict[str, Any]], i: int, images: ImageSink | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        param = f"messages[{i}].content[{j}]"
        if block.get("type") == "image" and images is not None:
            texts.append(images.add(_image_of(block, param)))
            continue
        if block.get("type") != "tool_result":
            texts.append(_text_of(block, param))
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        tool_use_id = block.get("tool_use_id")
        if not isinstance(tool_use_id, str) or not tool_use_id:
            raise InvalidRequestError(f"{param}.tool_use_id is required", param=param)
        content = _tool_result_text(block.get("content"), param)
        out.append({"role": "tool", "tool_call_id": tool_use_id, "content": content})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _image_of(block: dict[str, Any], param: str) -> ImagePart:
    """An ``image`` block's image: ``source`` base64 (or a data URL as ``url``)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        return from_base64(str(source.get("data") or ""), param)
    if kind == "url" and isinstance(source, dict):
        return from_data_url(str(source.get("url") or ""), param)
    raise InvalidRequestError(
        f"{param}.source: give an image as {{'type': 'base64', 'media_type': ..., 'data': ...}}",
        param=f"{param}.source",
    )


def _tool_result_text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param}.content must be a string or blocks", param=param)
    return "\n".join(_text_of(b, f"{param}.content[{k}]") for k, b in enumerate(content))


def _assistant_message(blocks: list[dict[str, Any]], i: int) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        param = f"messages[{i}].content[{j}]"
        kind = block.get("type")
        if kind in ("thinking", "redacted_thinking"):
            continue  # past reasoning stays out of the prompt, as chat templates expect
        if kind == "tool_use":
            calls.append(_tool_call(block, param))
        else:
            texts.append(_text_of(block, param))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
        raise InvalidRequestError(
            f"{param}: a tool_use block needs an 'id', a 'name' and an object 'input'",
            param=param,
        )
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def chat_tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """OpenAI function tools for the template; None when there are none to offer.
    Server tools (web search, code execution...) are left out (``server_tools``).

    tool_choice "any" and "tool" force calls through a grammar (``tool_constraint``).
    """
    if not body.tools or (body.tool_choice is not None and body.tool_choice.type == "none"):
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if is_anthropic_server_tool(tool.type):
            continue
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(
                f"tools[{i}]: tool type '{tool.type}' is not supported; send custom tools "
                "(server tools such as web_search_20250305 are left out of the prompt)",
                param=f"tools[{i}].type",
            )
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        if (tool.model_extra or {}).get("strict") is True:
            function["strict"] = True
        tools.append({"type": "function", "function": function})
    return tools or None


def server_tools(body: CountTokensRequest) -> tuple[str, ...]:
    """The types of the server tools the prompt leaves out, in request order."""
    return tuple(t.type for t in body.tools or () if t.type and is_anthropic_server_tool(t.type))


def template_kwargs(body: CountTokensRequest) -> dict[str, Any] | None:
    if body.thinking is None:
        return None
    return {"enable_thinking": body.thinking.type != "disabled"}


def sampling_request(body: MessagesRequest) -> SamplingRequest:
    return SamplingRequest(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        speculative=body.speculative,
    )


def output_grammar(body: MessagesRequest) -> GrammarSpec | ToolConstraint | None:
    """The one constraint of the request: the JSON output format asked for
    (output_config.format or output_format), or forced or strict tool calls."""
    return combined(_output_format(body), tool_constraint(body))


def tool_constraint(body: CountTokensRequest) -> ToolConstraint | None:
    """tool_choice "any" -> one or more calls, "tool" -> that tool; strict tools
    are constrained under "auto" too."""
    tools, choice = chat_tools(body), body.tool_choice
    kind = choice.type if choice is not None else "auto"
    if tools is None and kind in ("any", "tool"):
        raise InvalidRequestError(
            f"tool_choice '{kind}' needs at least one tool in 'tools'", param="tool_choice"
        )
    if tools is None or choice is None:
        return tool_constraint_of(tools, "auto", param="tools", schema_param=_SCHEMA_PARAM)
    parallel = not (choice.model_extra or {}).get("disable_parallel_tool_use")
    if kind != "tool":
        mode: Mode = "required" if kind == "any" else "auto"
        return tool_constraint_of(
            tools, mode, parallel=parallel, param="tool_choice", schema_param=_SCHEMA_PARAM
        )
    if not choice.name:
        raise InvalidRequestError("tool_choice 'tool' needs a 'name'", param="tool_choice.name")
    return tool_constraint_of(
        tools, "forced", names=[choice.name], param="tool_choice.name", schema_param=_SCHEMA_PARAM
    )


def _output_format(body: MessagesRequest) -> GrammarSpec | None:
    """The JSON output format asked for (output_config.format or output_format)."""
    fmt, param = body.output_config.format if body.output_config else None, "output_config.format"
    if fmt is None and body.output_format is not None:
        fmt, param = body.output_format, "output_format"
    extension = extension_spec(body.structured_outputs)
    if fmt is None:
        return extension
    if extension is not None:
        raise InvalidRequestError(
            f"use either {param} or structured_outputs, not both", param="structured_outputs"
        )
    if fmt.get("type") != "json_schema":
        raise InvalidRequestError(f"{param}.type must be 'json_schema'", param=f"{param}.type")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"{param}.schema must be a JSON schema object", param=f"{param}.schema"
        )
    return GrammarSpec.json_schema(schema, strict=True, param=f"{param}.schema")


# ---- engine events -> Messages response ---------------------------------------------


def stop_reason(
    finish_reason: str | None,
    has_tool_calls: bool,
    stop_sequence: str | None,
    window_bound: bool = False,
) -> str:
    """``window_bound``: the output budget was the room the prompt left (clamped), so
    reaching it means the context window is full, not that max_tokens was."""
    # Tool calls win even over max_tokens: the client must answer every tool_use.
    if has_tool_calls:
        return "tool_use"
    if finish_reason == "length":
        return "model_context_window_exceeded" if window_bound else "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


class MessageFormat:
    """One Messages response as it accumulates: stream frames per engine event, and
    the final body. Blocks are built once, so streamed and whole answers agree."""

    def __init__(
        self,
        message_id: str,
        model: str,
        parser: OutputParser,
        *,
        num_prompt_tokens: int,
        stop_sequences: tuple[str, ...] = (),
        reports_cache_writes: bool = False,
        window_bound: bool = False,
    ):
        self.message_id = message_id
        self.window_bound = window_bound
        self.model = model
        self.parser = parser
        self.stop_sequences = stop_sequences
        self.blocks: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        # Prompt tokens this request wrote to the prefix cache; reported as
        # cache_creation_input_tokens when the request asked for caching.
        self.num_cache_written_tokens = 0
        self.reports_cache_writes = reports_cache_writes
        self._open: str | None = None  # type of the last block while it takes deltas
        self._pending_ws = ""  # whitespace that would open a text block on its own

    def start(self) -> list[Frame]:
        """message_start: sent once the engine admitted the request, so its usage
        has the real split between cached and new prompt tokens."""
        message = {**self.body(), "content": [], "stop_reason": None}
        return [("message_start", {"type": "message_start", "message": message}), PING]

    def add(self, event: StreamEvent) -> list[Frame]:
        """Record an engine event; the frames to stream for it."""
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens
        self.num_cache_written_tokens = (
            event.num_cache_written_tokens or self.num_cache_written_tokens
        )
        frames = self._delta(self.parser.feed(event.text))
        if event.finish_reason is None:
            return frames
        self.finish_reason = event.finish_reason
        self.stop_sequence = event.stop_string
        frames += self._delta(self.parser.finish())
        frames += self._close()
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        frames.append(
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage()})
        )
        frames.append(("message_stop", {"type": "message_stop"}))
        return frames

    @property
    def stop_reason(self) -> str:
        has_tools = any(b["type"] == "tool_use" for b in self.blocks)
        return stop_reason(self.finish_reason, has_tools, self.stop_sequence, self.window_bound)

    def usage(self) -> dict[str, int]:
        # Anthropic's split: input + cache reads + cache writes = the prompt.
        written = self.num_cache_written_tokens if self.reports_cache_writes else 0
        return {
            "input_tokens": self.num_prompt_tokens - self.num_cached_tokens - written,
            "output_tokens": self.num_output_tokens,
            "cache_read_input_tokens": self.num_cached_tokens,
            "cache_creation_input_tokens": written,
        }

    def body(self) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": self.stop_reason if self.finish_reason else None,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(),
        }

    def _delta(self, parsed: ParsedDelta) -> list[Frame]:
        frames = []
        if parsed.reasoning:
            frames += self._text_delta("thinking", parsed.reasoning)
        if parsed.content:
            frames += self._text_delta("text", parsed.content)
        for call in parsed.tool_calls:
            frames += self._tool_use(call)
        return frames

    def _text_delta(self, kind: str, text: str) -> list[Frame]:
        frames: list[Frame] = []
        if self._open != kind:
            if kind == "text":
                text, self._pending_ws = self._pending_ws + text, ""
                if not text.strip():
                    self._pending_ws = text
                    return []
            frames += self._close()
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            frames.append(
                self._start(empty if kind == "thinking" else {"type": "text", "text": ""})
            )
            self._open = kind
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        frames.append(("content_block_delta", self._indexed("content_block_delta", delta=delta)))
        return frames

    def _tool_use(self, call: ToolCall) -> list[Frame]:
        self._pending_ws = ""
        frames = self._close()
        tool_id = "toolu_" + call.id.removeprefix("call_")
        frames.append(
            self._start({"type": "tool_use", "id": tool_id, "name": call.name, "input": {}})
        )
        self.blocks[-1]["input"] = json.loads(call.arguments)
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        frames.append(("content_block_delta", self._indexed("content_block_delta", delta=delta)))
        frames.append(("content_block_stop", self._indexed("content_block_stop")))
        return frames

    def _start(self, block: dict[str, Any]) -> Frame:
        self.blocks.append(dict(block))
        return ("content_block_start", self._indexed("content_block_start", content_block=block))

    def _close(self) -> list[Frame]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", self._indexed("content_block_stop"))]

    def _indexed(self, event_type: str, **fields: Any) -> dict[str, Any]:
        return {"type": event_type, "index": len(self.blocks) - 1, **fields}


def sse_event(frame: Frame) -> str:
    return sse_named(*frame)


class MessageEncoder(Encoder):
    """A Messages response on the wire: named SSE events, message_start once the engine
    admitted the request (pings cover the wait, and its usage has the real split between
    cached and new prompt tokens)."""

    def __init__(self, fmt: MessageFormat):
        self.fmt = fmt
        self._started = False

    def frames(self, index: int, event: StreamEvent) -> list[str]:
        frames = self.fmt.add(event)
        if not self._started:
            self._started, frames = True, self.fmt.start() + frames
        return [sse_event(f) for f in frames]

    def error_frames(self, error: OmlxError) -> list[str]:
        body = anthropic_error_body(error.message, error.error_type, error.http_status)
        return [sse_event(("error", body))]

    def keepalive(self) -> str | None:
        return sse_event(PING)  # Anthropic's keep-alive

    def body(self) -> dict[str, Any]:
        return self.fmt.body()
