"""Ollama's chat/generate API <-> our chat pipeline.

Requests become OpenAI-style messages, tools, sampling and a grammar (what
``render_chat``, ``build_sampling`` and ``bind_grammar`` take); engine events
become Ollama's NDJSON objects (``message`` / ``response`` deltas, then one
``done`` object with token counts and durations in nanoseconds).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from omlx.api.encoder import Encoder
from omlx.api.images import ImageSink, from_base64
from omlx.api.ollama_schemas import GenerateRequest, Message, Options, Think
from omlx.api.output_parser import OutputParser, ParsedDelta
from omlx.api.prompts import SamplingRequest
from omlx.api.tool_grammar import combined, openai_tool_constraint
from omlx.engine.stream import StreamEvent
from omlx.errors import ContextLengthExceededError, InvalidRequestError, OmlxError
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint

LATEST = ":latest"
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
# Longer than this is forever (and keeps /api/ps's expires_at a real date).
_FOREVER_S = 100 * 365 * 86400.0
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def now_iso() -> str:
    """Ollama's ``created_at``: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ollama_name(public_name: str) -> str:
    """How a model is listed to Ollama clients: ``NAME:latest``."""
    return public_name + LATEST


def omlx_name(requested: str) -> str:
    """``NAME`` or ``NAME:latest`` -> ``NAME`` (another tag stays, and is not found)."""
    return requested.removesuffix(LATEST)


# ---- keep_alive -----------------------------------------------------------------------


def keep_alive_s(value: float | str | None) -> float | None:
    """Ollama's keep_alive in idle seconds: None (not sent) -> the configured TTL;
    a number of seconds or a Go duration ("5m", "1h30m"); negative (or past any
    date we can show) -> math.inf."""
    if value is None:
        return None
    seconds = value if isinstance(value, float | int) else _duration_s(value.strip())
    if math.isnan(seconds):
        raise InvalidRequestError("keep_alive must be a number of seconds", param="keep_alive")
    return math.inf if seconds < 0 or seconds > _FOREVER_S else float(seconds)


def _duration_s(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    try:
        return sign * float(body)  # a bare number is seconds
    except ValueError:
        pass
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise InvalidRequestError(
            f"keep_alive '{text}' is not a duration; send seconds (300), a duration "
            "('5m', '1h30m'), 0 to unload after the request, or -1 to keep the model loaded",
            param="keep_alive",
        )
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


# ---- request -> chat template input ---------------------------------------------------


def chat_messages(messages: list[Message], images: ImageSink) -> list[dict[str, Any]]:
    """OpenAI-style messages: tool_calls get ids and JSON arguments; a tool answer
    names the call it answers (the latest unanswered one of that tool). A message's
    ``images`` go to ``images`` and stand before its text."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, tool name) not answered yet
    for i, msg in enumerate(messages):
        content = with_images(msg.content or "", msg.images, f"messages[{i}].images", images)
        entry: dict[str, Any] = {"role": msg.role, "content": content}
        if msg.tool_calls:
            entry["tool_calls"] = [
                _openai_call(f"call_{i}_{j}", c.function.name, c.function.arguments)
                for j, c in enumerate(msg.tool_calls)
            ]
            open_calls = [(c["id"], c["function"]["name"]) for c in entry["tool_calls"]]
        if msg.role == "tool":
            entry.update(_answered(open_calls, msg.tool_name, i))
        out.append(entry)
    return out


def _openai_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _answered(open_calls: list[tuple[str, str]], tool_name: str | None, i: int) -> dict[str, Any]:
    match = next((c for c in open_calls if tool_name in (None, c[1])), None)
    if match is not None:
        open_calls.remove(match)
    fields: dict[str, Any] = {"tool_call_id": match[0] if match else f"call_{i}"}
    if tool_name:
        fields["name"] = tool_name
    return fields


def with_images(text: str, images: list[str] | None, param: str, sink: ImageSink) -> str:
    """``text`` after the markers of its base64 ``images`` (Ollama's order: images first)."""
    markers = [sink.add(from_base64(data, f"{param}[{j}]")) for j, data in enumerate(images or [])]
    return "\n".join([*markers, text]) if markers else text


def generate_messages(body: GenerateRequest, images: ImageSink) -> list[dict[str, Any]]:
    """``/api/generate`` as a one-turn chat: the system text, then the prompt."""
    messages = [{"role": "system", "content": body.system}] if body.system else []
    prompt = with_images(body.prompt, body.images, "images", images)
    return [*messages, {"role": "user", "content": prompt}]


def check_generate(body: GenerateRequest) -> None:
    """400 for the generate fields omlx cannot honour, naming what to do instead."""
    if body.suffix:
        raise InvalidRequestError(
            "suffix (fill-in-the-middle) is not supported; send the prompt only",
            param="suffix",
        )
    if body.images and body.raw:
        raise InvalidRequestError(
            "images need the chat template to place them; with raw=true send no images",
            param="images",
        )
    if body.template:
        raise InvalidRequestError(
            "template is not supported: omlx renders the model's own chat template; "
            "send raw=true with a prompt you formatted yourself",
            param="template",
        )
    if body.context:
        raise InvalidRequestError(
            "context is not supported; send the conversation to /api/chat", param="context"
        )


def output_grammar(
    fmt: str | dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None = None,
) -> GrammarSpec | ToolConstraint | None:
    """``format`` ("json" or a schema), strict tools or a forced ``tool_choice``:
    the one grammar of the request."""
    return combined(_format_spec(fmt), openai_tool_constraint(tools, tool_choice))


def _format_spec(fmt: str | dict[str, Any] | None) -> GrammarSpec | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return GrammarSpec("json_object", param="format")
    if isinstance(fmt, dict):
        # Ollama has no strict flag: keywords the grammar cannot hold are flagged in
        # the X-Omlx-Unenforced-Schema-Keywords header, not refused.
        return GrammarSpec.json_schema(fmt, strict=True, param="format", refuse=False)
    raise InvalidRequestError(
        f"format '{fmt}' is not supported; send \"json\" or a JSON schema object",
        param="format",
    )


def template_kwargs(think: Think | None) -> dict[str, Any] | None:
    """``think`` for templates that take ``enable_thinking`` (an effort level also
    goes in as ``reasoning_effort``)."""
    if think is None:
        return None
    kwargs: dict[str, Any] = {"enable_thinking": think is not False}
    if isinstance(think, str):
        kwargs["reasoning_effort"] = think
    return kwargs


def sampling_request(
    options: Options | None, num_prompt_tokens: int, window: int, speculative: bool = True
) -> SamplingRequest:
    """``options`` over the defaults (the pipeline's output budget clamps
    ``num_predict`` to the room the prompt leaves, as Ollama does)."""
    opts = options or Options()
    return SamplingRequest(
        max_tokens=_max_tokens(opts, num_prompt_tokens, window),
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        min_p=opts.min_p,
        repetition_penalty=opts.repeat_penalty,
        seed=opts.seed,
        stop=tuple(opts.stop or ()),
        max_tokens_param="options.num_predict",
        speculative=speculative,
        context_limit=opts.num_ctx or None,
    )


def _max_tokens(opts: Options, num_prompt_tokens: int, window: int) -> int | None:
    """``num_ctx`` may shrink the window, not grow it. -1 and -2 fill the room it
    leaves. None: the server's default (with a smaller ``num_ctx``, its room)."""
    if opts.num_ctx and opts.num_ctx > window:
        raise InvalidRequestError(
            f"options.num_ctx ({opts.num_ctx}) is larger than the context window of this "
            f"model ({window}); send at most {window}",
            param="options.num_ctx",
        )
    limit = opts.num_ctx or window
    if limit < window and num_prompt_tokens >= limit:
        raise ContextLengthExceededError(
            f"the prompt is {num_prompt_tokens} tokens but options.num_ctx is {limit}; "
            "shorten the prompt or raise options.num_ctx",
            param="options.num_ctx",
        )
    room = max(1, limit - num_prompt_tokens)
    if opts.num_predict is None:
        return room if limit < window else None
    return room if opts.num_predict < 0 else max(1, opts.num_predict)


# ---- engine events -> Ollama objects ----------------------------------------------------


@dataclass(slots=True)
class Timings:
    """perf_counter seconds of one request's phases, for Ollama's *_duration fields."""

    start_s: float = field(default_factory=time.perf_counter)
    loaded_s: float | None = None
    submitted_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None

    def durations(self) -> dict[str, int]:
        done = self.done_s or time.perf_counter()
        loaded = self.loaded_s or done
        submitted = self.submitted_s or loaded
        first = self.first_token_s or done
        return {
            "total_duration": _ns(done - self.start_s),
            "load_duration": _ns(loaded - self.start_s),
            "prompt_eval_duration": _ns(first - submitted),
            "eval_duration": _ns(done - first),
        }


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


class OllamaReply:
    """One chat or generate answer as it accumulates: an NDJSON object per engine
    event, and the whole body; both built from the same parsed text."""

    def __init__(self, model: str, parser: OutputParser, timings: Timings, *, chat: bool):
        self.model = model
        self.parser = parser
        self.timings = timings
        self.chat = chat
        self.content = ""
        self.thinking = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0

    def add(self, event: StreamEvent) -> list[dict[str, Any]]:
        """Record an engine event; the objects to stream for it (the last has done)."""
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens
        if self.timings.first_token_s is None and event.num_output_tokens:
            self.timings.first_token_s = time.perf_counter()
        parsed = self.parser.feed(event.text)
        if event.finish_reason is not None:
            parsed = _joined(parsed, self.parser.finish())
        objects = [self._delta(parsed)] if parsed else []
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.timings.done_s = time.perf_counter()
            objects.append(self.done(self._part("", "", [])))
        return objects

    def body(self) -> dict[str, Any]:
        """The non-streamed answer: everything, with the done fields."""
        return self.done(self._part(self.content, self.thinking, self.tool_calls))

    def done(self, part: dict[str, Any]) -> dict[str, Any]:
        return {
            **part,
            "done": True,
            "done_reason": done_reason(self.finish_reason),
            **self.timings.durations(),
            "prompt_eval_count": self.num_prompt_tokens,
            "eval_count": self.num_output_tokens,
        }

    def _delta(self, parsed: ParsedDelta) -> dict[str, Any]:
        calls = [
            {"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
            for c in parsed.tool_calls
        ]
        self.content += parsed.content
        self.thinking += parsed.reasoning
        self.tool_calls += calls
        return {**self._part(parsed.content, parsed.reasoning, calls), "done": False}

    def _part(self, content: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        head = {"model": self.model, "created_at": now_iso()}
        if not self.chat:
            return {**head, "response": content, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {**head, "message": message}


def _joined(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(
        a.content + b.content, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls
    )


def loaded_reply(model: str, timings: Timings, *, chat: bool, reason: str) -> dict[str, Any]:
    """The answer to Ollama's load idiom (no prompt / no messages): done at once,
    with done_reason "load" or "unload"."""
    reply = OllamaReply(model, OutputParser(think=None), timings, chat=chat)
    timings.done_s = time.perf_counter()
    return {**reply.body(), "done_reason": reason}


def ndjson_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


class OllamaEncoder(Encoder):
    """An Ollama answer on the wire: one JSON object a line, an error mid-stream as an
    {"error"} line, nothing while waiting, as Ollama's."""

    media_type = "application/x-ndjson"

    def __init__(self, reply: OllamaReply, on_close: Callable[[], None]):
        self.reply = reply
        self.on_close = on_close  # keep_alive counts from the end of the request

    @property
    def headers(self) -> dict[str, str]:
        return {}

    def frames(self, index: int, event: StreamEvent) -> list[str]:
        return [ndjson_line(obj) for obj in self.reply.add(event)]

    def error_frames(self, error: OmlxError) -> list[str]:
        return [ndjson_line({"error": error.message})]

    def body(self) -> dict[str, Any]:
        return self.reply.body()

    def close(self) -> None:
        self.on_close()
