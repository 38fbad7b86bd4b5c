"""The recorder's answers on the wire: the streaming (SSE) and plain JSON shapes of the
Anthropic Messages, OpenAI Responses and OpenAI Chat Completions APIs."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from benchmarks.agent_traffic.scripted import Answer


def _anthropic_events(model: str, answer: Answer) -> list[tuple[str, dict[str, Any]]]:
    usage = {"input_tokens": 100, "output_tokens": 0}
    message = {
        # Unique per answer: Claude Code merges the blocks of messages that share an id.
        "id": f"msg_{answer.call_id or 'final'}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": message})
    ]
    if answer.tool_name:
        block = {
            "type": "tool_use",
            "id": f"toolu_{answer.call_id}",
            "name": answer.tool_name,
            "input": {},
        }
        delta = {"type": "input_json_delta", "partial_json": answer.arguments}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": answer.text}
        stop = "end_turn"
    events += [
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        ),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 10},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


def _responses_item(answer: Answer) -> dict[str, Any]:
    if answer.tool_name:
        return {
            "type": "function_call",
            "id": f"fc_{answer.call_id}",
            "call_id": answer.call_id,
            "name": answer.tool_name,
            "arguments": answer.arguments,
            "status": "completed",
        }
    part = {"type": "output_text", "text": answer.text, "annotations": []}
    return {
        "type": "message",
        "id": f"msg_{answer.call_id or 'final'}",
        "role": "assistant",
        "status": "completed",
        "content": [part],
    }


def _responses_events(model: str, answer: Answer) -> list[tuple[str, dict[str, Any]]]:
    response = {
        "id": "resp_rec",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "output": [],
    }
    item = _responses_item(answer)
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"type": "response.created", "response": response}),
        ("response.in_progress", {"type": "response.in_progress", "response": response}),
        (
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "status": "in_progress"},
            },
        ),
    ]
    where = {"item_id": item["id"], "output_index": 0}
    if answer.tool_name:
        events += [
            (
                "response.function_call_arguments.delta",
                {
                    "type": "response.function_call_arguments.delta",
                    **where,
                    "delta": answer.arguments,
                },
            ),
            (
                "response.function_call_arguments.done",
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "arguments": answer.arguments,
                },
            ),
        ]
    else:
        part = item["content"][0]
        events += [
            (
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    **where,
                    "content_index": 0,
                    "part": {**part, "text": ""},
                },
            ),
            (
                "response.output_text.delta",
                {
                    "type": "response.output_text.delta",
                    **where,
                    "content_index": 0,
                    "delta": answer.text,
                },
            ),
            (
                "response.output_text.done",
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": answer.text,
                },
            ),
            (
                "response.content_part.done",
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ),
        ]
    usage = {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 10,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 110,
    }
    done = {**response, "status": "completed", "output": [item], "usage": usage}
    events += [
        (
            "response.output_item.done",
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ),
        ("response.completed", {"type": "response.completed", "response": done}),
    ]
    for number, (_, data) in enumerate(events):
        data["sequence_number"] = number
    return events


def _chat_chunks(model: str, answer: Answer) -> list[dict[str, Any]]:
    base = {
        "id": "chatcmpl-rec",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    if answer.tool_name:
        call = {
            "index": 0,
            "id": answer.call_id,
            "type": "function",
            "function": {"name": answer.tool_name, "arguments": answer.arguments},
        }
        delta: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        delta = {"role": "assistant", "content": answer.text}
        finish = "stop"
    usage = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
    return [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
        {**base, "choices": [], "usage": usage},
    ]


def _plain(kind: str, model: str, answer: Answer) -> dict[str, Any]:
    if kind == "anthropic":
        events = _anthropic_events(model, answer)
        message = events[0][1]["message"]
        block = events[1][1]["content_block"]
        if answer.tool_name:
            block = {**block, "input": json.loads(answer.arguments or "{}")}
        else:
            block = {**block, "text": answer.text}
        stop = events[4][1]["delta"]["stop_reason"]
        return {**message, "content": [block], "stop_reason": stop}
    if kind == "responses":
        return _responses_events(model, answer)[-1][1]["response"]
    chunks = _chat_chunks(model, answer)
    message = {k: v for k, v in chunks[0]["choices"][0]["delta"].items() if v is not None}
    finish = chunks[1]["choices"][0]["finish_reason"]
    return {
        **chunks[0],
        "object": "chat.completion",
        "usage": chunks[2]["usage"],
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def stream_answer(
    handler: BaseHTTPRequestHandler, kind: str, body: dict[str, Any], answer: Answer
) -> None:
    """Write ``answer`` as the response ``body`` asked for (SSE when it set stream)."""
    model = str(body.get("model") or "agent-model")
    handler.close_connection = True
    if not body.get("stream"):
        data = json.dumps(_plain(kind, model, answer)).encode()
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        handler.send_header("connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
        return
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("cache-control", "no-cache")
    handler.send_header("connection", "close")
    handler.end_headers()
    if kind == "chat":
        lines = [f"data: {json.dumps(c)}\n\n" for c in _chat_chunks(model, answer)]
        lines.append("data: [DONE]\n\n")
    else:
        events = (_anthropic_events if kind == "anthropic" else _responses_events)(model, answer)
        lines = [f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events]
    for line in lines:
        handler.wfile.write(line.encode())
        handler.wfile.flush()
