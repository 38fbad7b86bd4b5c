"""The one request pipeline every generating API runs.

lease -> prompts (the model's template kwargs, its locks over the request's) ->
sampling (the model's defaults, ``force_sampling``, its ``max_tokens``; the output
budget clamped to the room the prompt leaves) -> grammar ->
requests -> encoder -> submit -> stream or collect (499 when the client leaves) ->
headers. An API's route turns its body into a ``Call`` and names an ``Encoder``
factory; adding an API is an adapter and an encoder, nothing else.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx.api.encoder import Encoder
from omlx.api.generation import ClientGone, Generation, unless_disconnected
from omlx.api.images import ImageSink
from omlx.api.metrics import observer_for
from omlx.api.output_budget import OutputBudget, clamped_header, output_budget
from omlx.api.output_parser import OutputParser, parser_for
from omlx.api.prompts import (
    RenderedPrompt,
    SamplingRequest,
    build_sampling,
    choice_requests,
    render_chat,
)
from omlx.api.render_pool import RenderPool
from omlx.api.state import ServerState, state_of
from omlx.api.structured import bind_grammar, with_unenforced_header
from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import StreamEvent
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import ToolConstraint
from omlx.scheduler import Request as EngineRequest
from omlx.scheduler import SamplingParams

Item = tuple[int, StreamEvent]
# The prompts of a call: (the rendering context) -> one prompt per request group.
PromptMaker = Callable[["Rendering"], Awaitable[list[RenderedPrompt]]]
# A sampling request that depends on (prompt tokens, context window): Ollama's num_ctx.
SamplingFor = Callable[[int, int], SamplingRequest]


@dataclass(frozen=True, slots=True)
class Call:
    """What one API request asks of the pipeline, in no API's shape."""

    model: str  # the name the pool resolves (an alias, a folder name)
    kind: str  # the log line's label
    id_prefix: str  # ids are the prefix and a random hex ("chatcmpl-", "msg_")
    messages: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-style chat
    tools: list[dict[str, Any]] | None = None  # rendered and parsed (None: hidden)
    images: ImageSink | None = None  # the image parts found in ``messages``
    # What the request asks; the model's chat_template_kwargs and locks apply over it.
    template_kwargs: dict[str, Any] | None = None
    sampling: SamplingRequest | SamplingFor = field(default_factory=SamplingRequest)
    spec: GrammarSpec | ToolConstraint | None = None
    n: int = 1
    stream: bool = False
    # Split think blocks out of the text (None: when the model's tokenizer thinks).
    reasoning: bool | None = None
    # Streams get the engine's admission notice first (see RequestStream).
    wants_admission: bool = False
    # The API's own prompts (token-id prompts, raw text, truncation); None: render
    # ``messages`` with the model's chat template.
    prompts: PromptMaker | None = None
    # Headers the answer carries from the API's own reading of the body (what it left out).
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Rendering:
    """What rendering a call's prompts needs, the model's template kwargs applied."""

    engine: ModelEngine
    template_kwargs: dict[str, Any]
    timeout_s: float
    renderer: RenderPool

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: ImageSink | None,
    ) -> RenderedPrompt:
        return await render_chat(
            self.engine,
            messages,
            tools=tools,
            renderer=self.renderer,
            template_kwargs=self.template_kwargs,
            timeout_s=self.timeout_s,
            images=images,
        )


@dataclass(frozen=True, slots=True)
class Prepared:
    """A call made concrete for one engine: what an encoder is built from."""

    call: Call
    engine: ModelEngine
    model: str  # the name clients see (an alias when the model has one)
    request_id: str
    prompts: list[RenderedPrompt]
    params: list[SamplingParams]  # one per prompt
    budgets: list[OutputBudget]  # one per prompt: what bounded its max_tokens
    leased_s: float  # when the engine was in hand (loaded)
    renderer: RenderPool  # for an encoder's own tokenizer work (echoed prompts)

    def parser(self, prompt: int = 0) -> OutputParser:
        """A fresh output parser for one choice of prompt ``prompt``."""
        tokenizer = self.engine.tokenizer
        reasoning = self.call.reasoning
        if reasoning is None:
            reasoning = bool(getattr(tokenizer, "has_thinking", False))
        return parser_for(
            tokenizer,
            tools_requested=bool(self.call.tools),
            reasoning=reasoning,
            prompt_text=self.prompts[prompt].text,
            tool_schemas=self.call.tools,
        )


EncoderFactory = Callable[[Prepared], Awaitable[Encoder]]


async def run(request: Request, call: Call, encoder: EncoderFactory) -> Response:
    """Generate for ``call`` and answer in the encoder's shape."""
    state = state_of(request)
    # The lease keeps unload/release from taking the engine before the submit.
    async with state.pool.lease(call.model) as engine:
        prepared = await _prepare(state, call, engine)
        grammar = await bind_grammar(engine, call.spec, state.compile_pool)
        requests = _engine_requests(prepared, grammar)
        enc = await encoder(prepared)
        gen = Generation(
            engine, requests, observer=observer_for(request), wants_admission=call.wants_admission
        )
        tally = _Tally(gen, call.kind, len(requests), call.n)
        if all(r.sampling.max_tokens == 0 for r in requests):
            events = _finished_at_once(requests)  # nothing to generate: echo only
        else:
            gen.submit()
            events = gen.events(state.settings.server.sse_keepalive_s)
    if call.stream:
        frames = _stream(events, enc, tally, gen.abort_unfinished)
        response: Response = StreamingResponse(
            frames, media_type=enc.media_type, headers=enc.headers
        )
    else:
        response = await _whole(request, events, enc, tally, gen.abort_unfinished)
    response.headers.update(call.headers)
    response.headers.update(clamped_header(prepared.request_id, prepared.budgets))
    return with_unenforced_header(response, call.spec, prepared.request_id)


async def prompt_tokens(request: Request, call: Call) -> int:
    """How many tokens ``call``'s prompt is for its model (the count_tokens routes)."""
    state = state_of(request)
    engine = await state.pool.get_engine(call.model, kind="chat")
    prompts = await _prompts(_rendering(state, call, engine), call)
    return sum(len(p.ids) for p in prompts)


def _rendering(state: ServerState, call: Call, engine: ModelEngine) -> Rendering:
    defaults = state.pool.request_defaults(engine.name)
    return Rendering(
        engine,
        defaults.template_kwargs(call.template_kwargs),
        state.settings.server.template_timeout_s,
        state.render_pool,
    )


async def _prompts(rendering: Rendering, call: Call) -> list[RenderedPrompt]:
    if call.prompts is not None:
        return await call.prompts(rendering)
    return [await rendering.chat(call.messages, call.tools, call.images)]


async def _prepare(state: ServerState, call: Call, engine: ModelEngine) -> Prepared:
    leased_s = time.perf_counter()
    prompts = await _prompts(_rendering(state, call, engine), call)
    defaults = state.pool.request_defaults(engine.name)
    params, budgets = [], []
    for prompt in prompts:
        wanted = call.sampling
        if not isinstance(wanted, SamplingRequest):
            wanted = wanted(len(prompt.ids), engine.context_window)
        budget = output_budget(
            engine.name,
            engine.context_window,
            len(prompt.ids),
            wanted,
            defaults.generation.max_tokens,
            strict=defaults.model.strict_max_tokens,
        )
        budgets.append(budget)
        params.append(
            build_sampling(engine, budget.max_tokens, wanted, defaults.sampling, defaults.forced)
        )
    request_id = call.id_prefix + uuid.uuid4().hex
    model = state.pool.public_name(engine.name)
    return Prepared(
        call, engine, model, request_id, prompts, params, budgets, leased_s, state.render_pool
    )


def _engine_requests(prepared: Prepared, grammar: Any) -> list[EngineRequest]:
    """``n`` requests per prompt, prompt-major (choice p * n + j is prompt p's j-th)."""
    many = len(prepared.prompts) > 1
    requests = []
    for i, (prompt, params) in enumerate(zip(prepared.prompts, prepared.params, strict=True)):
        rid = f"{prepared.request_id}-{i}" if many else prepared.request_id
        n = prepared.call.n
        requests += choice_requests(rid, prompt.ids, params, grammar, n, prompt.images)
    return requests


async def _finished_at_once(requests: list[EngineRequest]) -> AsyncGenerator[Item | None, None]:
    """Each request done before it starts (``max_tokens`` 0: the prompt is the answer)."""
    for i, request in enumerate(requests):
        yield i, StreamEvent(num_prompt_tokens=len(request.prompt_ids), finish_reason="length")


@dataclass(slots=True)
class _Tally:
    """Counts a call's events for its one log line, written when every choice ends."""

    gen: Generation
    kind: str
    num_choices: int
    n: int
    prompt: dict[int, int] = field(default_factory=dict)
    output: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)

    def add(self, index: int, event: StreamEvent) -> bool:
        """Record the event; True when it finished the call's last choice."""
        self.prompt[index] = event.num_prompt_tokens or self.prompt.get(index, 0)
        self.output[index] = event.num_output_tokens or self.output.get(index, 0)
        if event.finish_reason is None:
            return False
        self.reasons[index] = event.finish_reason
        if len(self.reasons) < self.num_choices:
            return False
        # A prompt's n choices share it: count it once.
        prompt = sum(v for i, v in self.prompt.items() if i % self.n == 0)
        reasons = [self.reasons[i] for i in sorted(self.reasons)]
        self.gen.log_done(self.kind, prompt, sum(self.output.values()), reasons)
        return True


async def _whole(
    request: Request,
    events: AsyncGenerator[Item | None, None],
    enc: Encoder,
    tally: _Tally,
    abort: Callable[[], None],
) -> Response:
    """Collect every event, then answer with the encoder's body (499: client gone)."""
    try:
        await unless_disconnected(request, _collect(events, enc, tally, abort), abort)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed"
    finally:
        enc.close()
    await enc.finished()
    return JSONResponse(enc.body())


async def _collect(
    events: AsyncGenerator[Item | None, None],
    enc: Encoder,
    tally: _Tally,
    abort: Callable[[], None],
) -> None:
    """An error event aborts the rest and is raised (the API's error body answers)."""
    async with aclosing(events) as items:
        async for item in items:
            if item is None:
                continue
            index, event = item
            if event.error is not None:
                abort()
                raise event.error
            enc.frames(index, event)
            tally.add(index, event)


async def _stream(
    events: AsyncGenerator[Item | None, None],
    enc: Encoder,
    tally: _Tally,
    abort: Callable[[], None],
) -> AsyncIterator[str]:
    """The encoder's frames as events come; the client going away aborts the call."""
    try:
        for frame in enc.opening():
            yield frame
        # aclosing: a disconnect cancels us mid-iteration; close the pump tasks now.
        async with aclosing(events) as items:
            async for item in items:
                if item is None:
                    keepalive = enc.keepalive()
                    if keepalive is not None:
                        yield keepalive
                    continue
                index, event = item
                if event.error is not None:
                    for frame in enc.error_frames(event.error):
                        yield frame
                    return
                out = enc.frames(index, event)
                if tally.add(index, event):
                    await enc.finished()
                    out += enc.closing()
                for frame in out:
                    yield frame
    finally:
        abort()
        enc.close()
