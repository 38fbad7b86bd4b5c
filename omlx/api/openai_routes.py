"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx.api.generation import ClientGone, Generation, sse_stream, unless_disconnected
from omlx.api.prompts import (
    chat_prompt_ids,
    completion_prompt_ids,
    make_request,
    new_request_id,
    sampling_params,
)
from omlx.api.schemas import ChatCompletionRequest, CompletionRequest
from omlx.api.state import ServerState
from omlx.engine.stream import StreamEvent
from omlx.errors import InvalidRequestError

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request) -> ServerState:
    return request.app.state.omlx


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    models = state.pool.available()
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": int(info.path.stat().st_mtime),
                "owned_by": "omlx",
            }
            for name, info in sorted(models.items())
        ],
    }


@dataclass(slots=True)
class _Choice:
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, event: StreamEvent) -> None:
        self.text += event.text
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens


def _usage(choices: list[_Choice]) -> dict[str, int]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    output = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


async def _run(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    gen: Generation,
    kind: str,
    chunk_fn: Any,
    final_fn: Any,
) -> Response:
    state = _state(request)
    choices = [_Choice() for _ in gen.requests]
    gen.submit()

    def track(index: int, event: StreamEvent) -> dict[str, Any] | None:
        choices[index].add(event)
        if event.finished and all(c.finish_reason for c in choices):
            gen.log_done(kind, *_totals(choices))
        return chunk_fn(index, event)

    def tail() -> list[dict[str, Any]]:
        opts = body.stream_options
        if opts is not None and opts.include_usage:
            return [{**chunk_fn.base, "choices": [], "usage": _usage(choices)}]
        return []

    if body.stream:
        frames = sse_stream(gen, state.settings.server.sse_keepalive_s, track, tail)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> None:
        async for item in gen.events(keepalive_s=3600.0):
            if item is None:
                continue
            index, event = item
            if event.error is not None:
                gen.abort_unfinished()
                raise event.error
            track(index, event)

    try:
        await unless_disconnected(request, collect(), gen.abort_unfinished)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(final_fn(choices, _usage(choices)))


def _totals(choices: list[_Choice]) -> tuple[int, int, list[str]]:
    usage = _usage(choices)
    return (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        [c.finish_reason or "" for c in choices],
    )


class _Chunker:
    """Builds stream chunks; ``base`` holds the fields every chunk repeats."""

    def __init__(self, base: dict[str, Any], make: Any):
        self.base = base
        self._make = make

    def __call__(self, index: int, event: StreamEvent) -> dict[str, Any] | None:
        return self._make(self.base, index, event)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine = await state.pool.get_engine(body.model)
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise InvalidRequestError(
            f"response_format '{fmt}' (structured output) is not available in this server "
            "build; remove response_format",
            param="response_format",
        )
    prompt_ids = chat_prompt_ids(engine, body)
    params = sampling_params(
        body, len(prompt_ids), engine, state.settings.sampling, state.settings.generation
    )
    rid = new_request_id("chatcmpl")
    gen = Generation(engine, [make_request(rid, prompt_ids, params)])
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": engine.name,
    }
    started = [False]

    def chunk(base: dict[str, Any], index: int, event: StreamEvent) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"content": event.text} if event.text else {}
        if not started[0]:
            started[0] = True
            delta = {"role": "assistant", "content": event.text}
        if not delta and not event.finish_reason:
            return None
        return {
            **base,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            ],
        }

    def final(choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion",
            "created": base["created"],
            "model": engine.name,
            "usage": usage,
            "choices": [
                {
                    "index": i,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "message": {"role": "assistant", "content": c.text},
                }
                for i, c in enumerate(choices)
            ],
        }

    return await _run(request, body, gen, "chat", _Chunker(base, chunk), final)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine = await state.pool.get_engine(body.model)
    if body.suffix:
        raise InvalidRequestError("'suffix' is not supported", param="suffix")
    prompts = completion_prompt_ids(engine, body)
    rid = new_request_id("cmpl")
    requests = []
    for i, ids in enumerate(prompts):
        params = sampling_params(
            body, len(ids), engine, state.settings.sampling, state.settings.generation
        )
        requests.append(make_request(f"{rid}-{i}", ids, params))
    echoes = [engine.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    gen = Generation(engine, requests)
    base = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.name,
    }
    echoed = [False] * len(prompts)

    def chunk(base: dict[str, Any], index: int, event: StreamEvent) -> dict[str, Any] | None:
        text = event.text
        if not echoed[index]:
            echoed[index] = True
            text = echoes[index] + text
        if not text and not event.finish_reason:
            return None
        return {
            **base,
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            ],
        }

    def final(choices: list[Any], usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": base["created"],
            "model": engine.name,
            "usage": usage,
            "choices": [
                {
                    "index": i,
                    "text": echoes[i] + c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
        }

    return await _run(request, body, gen, "completion", _Chunker(base, chunk), final)
