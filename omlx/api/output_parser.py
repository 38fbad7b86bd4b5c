"""Split streamed model output into visible content, reasoning and tool calls.

``OutputParser.feed`` takes generated text in arbitrary chunks (a marker may be
split anywhere: "</thi" + "nk>") and returns what can be shown now: text between
think markers as ``reasoning``, tool-call markup parsed into ``ToolCall``s, the
rest as ``content``. Text that could be the start of a marker is held back until
it is completed or ruled out, and a tool-call block is held whole until its end
marker, so content never shows markup. A block that does not parse comes back as
text (and a WARNING is logged); nothing here raises on model output.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omlx.api.tool_recovery import bare_calls, json_values

log = logging.getLogger(__name__)

DEFAULT_THINK = ("<think>", "</think>")
DEFAULT_TOOL_START = "<tool_call>"
DEFAULT_TOOL_END = "</tool_call>"
# tool_format names whose calls are JSON {"name", "arguments"} in <tool_call> tags.
HERMES_FORMATS = ("hermes", "json_tools")

Arguments = dict[str, Any]
ParseFn = Callable[[str], list[tuple[str, Arguments]]]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_" + 24 hex chars
    name: str
    arguments: str  # a JSON object

    @classmethod
    def create(cls, name: str, arguments: Arguments) -> ToolCall:
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        return cls(f"call_{uuid.uuid4().hex[:24]}", name, text)


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ToolMarkup:
    """How a model writes tool calls: ``start`` body ``end``.

    ``parse`` turns a body (markers excluded) into [(name, arguments)] and raises
    ValueError when it is malformed. An empty ``end`` (Mistral's "[TOOL_CALLS]")
    means the block runs to the end of the output.
    """

    start: str
    end: str
    parse: ParseFn


class _Mode(Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL = "tool"


class OutputParser:
    """One per generation: ``feed`` every chunk, then ``finish`` once.

    Reasoning starts at the think start marker, or at the very beginning when
    ``starts_in_reasoning`` (the chat template opened it in the prompt); a lone
    end marker is never guessed at. Whitespace right after the think end marker
    is dropped from content. Tool markup is recognised only when ``tools`` is
    given, in content and in reasoning (models do call tools before closing
    </think>); after the block, output continues in the mode it came from.
    """

    def __init__(
        self,
        *,
        think: tuple[str, str] | None = DEFAULT_THINK,
        starts_in_reasoning: bool = False,
        tools: ToolMarkup | None = None,
        tool_names: frozenset[str] = frozenset(),
    ):
        self._think = think if think and all(think) else None
        self._tools = tools if tools and tools.start else None
        # The declared tools: an answer that is nothing but a call of one of them,
        # without its markup, is that call (tool_recovery.py).
        self._names = tool_names if self._tools is not None else frozenset()
        # Content held while it may be such a call (None: not holding).
        self._bare: str | None = "" if self._names else None
        in_reasoning = starts_in_reasoning and self._think is not None
        self._mode = _Mode.REASONING if in_reasoning else _Mode.CONTENT
        self._resume = _Mode.CONTENT  # the mode a tool block returns to
        self._held = ""  # text that may be the start of a marker
        self._body = ""  # the open tool block so far
        self._strip_ws = False  # just after the think end marker
        self._saw_tool_calls = False

    @property
    def saw_tool_calls(self) -> bool:
        return self._saw_tool_calls

    def feed(self, text: str) -> ParsedDelta:
        """Everything in ``text`` (and text held before) that is decided now."""
        out = ParsedDelta()
        buf, self._held = self._held + text, ""
        while buf:
            if self._mode is _Mode.TOOL:
                buf = self._feed_tool(buf, out)
            else:
                buf = self._feed_text(buf, out)
        return out

    def finish(self) -> ParsedDelta:
        """End of generation: flush what is held back.

        An unterminated tool block is parsed anyway (models often stop at EOS
        right before the end marker); if that fails it comes back as text.
        """
        out = ParsedDelta()
        if self._mode is _Mode.TOOL:
            assert self._tools is not None
            body, self._body = self._body, ""
            complete = body[: len(body) - _partial_suffix(body, [self._tools.end])]
            self._close_block(complete, self._tools.start + body, out)
        held, self._held = self._held, ""
        self._emit(held, out)
        self._resolve_bare(out)
        return out

    def _resolve_bare(self, out: ParsedDelta) -> None:
        """The held answer as tool calls when it is nothing else, or as text."""
        if self._bare is None:
            return
        held, self._bare = self._bare, None
        assert self._tools is not None
        markers = (self._tools.start, self._tools.end)
        calls = bare_calls(held, self._names, markers, _name_and_arguments) if held else None
        if calls is None:
            out.content += held
            return
        log.info("tool call without its markup recovered: %.200r", held)
        out.tool_calls.extend(ToolCall.create(name, arguments) for name, arguments in calls)
        self._saw_tool_calls = True

    def _markers(self) -> list[str]:
        markers = []
        if self._think is not None:
            markers.append(self._think[0] if self._mode is _Mode.CONTENT else self._think[1])
        if self._tools is not None:
            markers.append(self._tools.start)
        return markers

    def _feed_text(self, buf: str, out: ParsedDelta) -> str:
        """Emit ``buf`` up to the first marker and switch mode; returns the rest."""
        markers = self._markers()
        hit = _first_marker(buf, markers)
        if hit is None:
            cut = len(buf) - _partial_suffix(buf, markers)
            self._emit(buf[:cut], out)
            self._held = buf[cut:]
            return ""
        at, marker = hit
        self._emit(buf[:at], out)
        self._enter(marker)
        return buf[at + len(marker) :]

    def _enter(self, marker: str) -> None:
        if self._tools is not None and marker == self._tools.start:
            self._resume, self._mode = self._mode, _Mode.TOOL
        elif self._mode is _Mode.CONTENT:
            self._mode = _Mode.REASONING
        else:
            self._mode = _Mode.CONTENT
            self._strip_ws = True

    def _feed_tool(self, buf: str, out: ParsedDelta) -> str:
        """Add ``buf`` to the open block; at its end marker parse it, return the rest."""
        assert self._tools is not None
        end = self._tools.end
        searched = max(0, len(self._body) - len(end) + 1)
        self._body += buf
        at = self._body.find(end, searched) if end else -1
        if at < 0:
            return ""
        body, rest = self._body[:at], self._body[at + len(end) :]
        self._body = ""
        self._close_block(body, self._tools.start + body + end, out)
        return rest

    def _close_block(self, body: str, raw: str, out: ParsedDelta) -> None:
        self._mode = self._resume
        calls = self._parse(body)
        if calls is None:
            self._emit(raw, out)
            return
        out.tool_calls.extend(calls)
        self._saw_tool_calls = True

    def _parse(self, body: str) -> list[ToolCall] | None:
        assert self._tools is not None
        try:
            parsed = self._tools.parse(body)
            if not parsed:
                raise ValueError("no tool call in the block")
            return [ToolCall.create(name, arguments) for name, arguments in parsed]
        except (ValueError, TypeError) as exc:  # TypeError: arguments json.dumps rejects
            log.warning("malformed tool call returned as text (%s): %.200r", exc, body)
            return None

    def _emit(self, text: str, out: ParsedDelta) -> None:
        if self._mode is _Mode.REASONING:
            out.reasoning += text
            return
        if self._strip_ws:
            text = text.lstrip()
            self._strip_ws = not text
        if self._bare is not None:
            self._bare += text
            if _may_be_bare_call(self._bare):
                return
            text, self._bare = self._bare, None
        out.content += text


def _may_be_bare_call(text: str) -> bool:
    """Whether an answer starting so may turn out to be a call without its markup."""
    head = text.lstrip()
    return any(head.startswith(o) or o.startswith(head) for o in _BARE_OPENINGS)


_BARE_OPENINGS = ("{", "[{", "```")


def _first_marker(buf: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest marker in ``buf`` (the longest one on a tie)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = buf.find(marker)
        if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
            best = (at, marker)
    return best


def _partial_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that starts some marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), best, -1):
            if marker.startswith(buf[-n:]):
                best = n
                break
    return best


def json_tool_call(body: str) -> list[tuple[str, Arguments]]:
    """The Hermes / Qwen format: {"name": ..., "arguments": {...}} or a JSON list of them.

    "parameters" is accepted for "arguments", and arguments may be a JSON string
    holding an object. Several calls in one block and stray closing punctuation after
    the JSON are read (tool_recovery.py). Raises ValueError (json.JSONDecodeError is
    one) when malformed.
    """
    calls = [c for v in json_values(body) for c in (v if isinstance(v, list) else [v])]
    if not calls:
        raise ValueError("an empty list of tool calls")
    return [_name_and_arguments(call) for call in calls]


def _name_and_arguments(call: Any) -> tuple[str, Arguments]:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError("a tool call must be an object with a non-empty 'name'")
    arguments = call.get("arguments", call.get("parameters"))
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}
    elif isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return call["name"], arguments


def mlx_tool_parser(
    parse_tool_call: Callable[..., Any], tool_schemas: Sequence[dict[str, Any]] | None = None
) -> ParseFn:
    """Adapt an mlx-lm ``parse_tool_call(text, tools) -> dict | list[dict]``.

    ``tool_schemas`` is the request's OpenAI ``tools`` list (plain dicts); some
    parsers (qwen3_coder, minimax_m2, glm47) read parameter types from it.
    """
    schemas = list(tool_schemas) if tool_schemas else None

    def parse(body: str) -> list[tuple[str, Arguments]]:
        try:
            parsed = parse_tool_call(body, schemas)
        except Exception as exc:  # parsers also raise SyntaxError, KeyError, IndexError...
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc
        calls = parsed if isinstance(parsed, list) else [parsed]
        if any(_is_glm_fallback(call) for call in calls):
            raise ValueError("no function name in the tool call")
        return [_name_and_arguments(call) for call in calls]

    return parse


def _is_glm_fallback(call: Any) -> bool:
    # glm47 (and laguna) return this instead of raising when nothing parses.
    return (
        isinstance(call, dict)
        and call.get("name") == "unknown"
        and isinstance(call.get("arguments"), dict)
        and set(call["arguments"]) == {"raw"}
    )


def parser_for(
    tokenizer: Any,
    *,
    tools_requested: bool,
    reasoning: bool = True,
    prompt_text: str = "",
    tool_schemas: Sequence[dict[str, Any]] | None = None,
) -> OutputParser:
    """An OutputParser for a model's tokenizer (mlx-lm's TokenizerWrapper or anything else).

    ``reasoning=False`` leaves think markers in the content. ``prompt_text`` (the
    rendered chat prompt) decides ``starts_in_reasoning``: the prompt opened the
    think block and did not close it. ``tool_schemas`` is passed to mlx-lm parsers.
    """
    think = think_markers(tokenizer) if reasoning else None
    opened = think is not None and prompt_text.rfind(think[0]) > prompt_text.rfind(think[1])
    tools = _tool_markup(tokenizer, tool_schemas) if tools_requested else None
    names = frozenset(
        str(t["function"]["name"])
        for t in tool_schemas or ()
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]
    )
    return OutputParser(think=think, starts_in_reasoning=opened, tools=tools, tool_names=names)


def _str_attr(tokenizer: Any, name: str) -> str | None:
    # Plain HF tokenizers and test doubles lack these TokenizerWrapper properties.
    value = getattr(tokenizer, name, None)
    return value if isinstance(value, str) else None


def think_markers(tokenizer: Any) -> tuple[str, str]:
    start, end = _str_attr(tokenizer, "think_start"), _str_attr(tokenizer, "think_end")
    return (start, end) if start and end else DEFAULT_THINK


def tool_format(tokenizer: Any) -> str:
    """The name of the tool-call format ``parser_for`` parses for this tokenizer:
    mlx-lm's parser module ("json_tools", "qwen3_coder"...), or "hermes" (the default)."""
    start, end = _str_attr(tokenizer, "tool_call_start"), _str_attr(tokenizer, "tool_call_end")
    parse_tool_call = getattr(tokenizer, "tool_parser", None)
    if start and end is not None and callable(parse_tool_call):
        return str(getattr(parse_tool_call, "__module__", "")).rpartition(".")[2] or "unknown"
    return "hermes"


def _tool_markup(tokenizer: Any, tool_schemas: Sequence[dict[str, Any]] | None) -> ToolMarkup:
    start, end = _str_attr(tokenizer, "tool_call_start"), _str_attr(tokenizer, "tool_call_end")
    parse_tool_call = getattr(tokenizer, "tool_parser", None)
    if start and end is not None and callable(parse_tool_call):
        return ToolMarkup(start, end, mlx_tool_parser(parse_tool_call, tool_schemas))
    return ToolMarkup(DEFAULT_TOOL_START, DEFAULT_TOOL_END, json_tool_call)
