"""Turn validated request bodies into scheduler Requests.

Templates are rendered and prompts tokenized on the render pool (render_pool.py),
never on the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from omlx.api.image_fetch import fetch_images
from omlx.api.images import ImageSink, PromptImages, from_data_url, process
from omlx.api.output_parser import HERMES_FORMATS, tool_format
from omlx.api.render_pool import RenderPool
from omlx.api.schemas import ChatCompletionRequest, CompletionRequest, PromptField
from omlx.engine.model_engine import ModelEngine
from omlx.errors import InvalidRequestError
from omlx.scheduler import Request, SamplingParams
from omlx.settings import SamplingSettings

log = logging.getLogger(__name__)


def _message_text(content: Any, index: int, images: ImageSink | None = None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "image_url" and images is not None:
            where = f"messages[{index}].content[{j}]"
            parts.append(images.add(from_data_url(_image_url(part, where), where)))
            continue
        if kind not in ("text", "input_text"):
            raise InvalidRequestError(
                f"messages[{index}].content[{j}]: content type '{kind}' is not supported; "
                "send text parts only",
                param=f"messages[{index}].content",
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _image_url(part: dict[str, Any], where: str) -> str:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise InvalidRequestError(f"{where}: image_url.url must be a string", param=where)
    return url


def chat_messages(
    body: ChatCompletionRequest, images: ImageSink | None = None
) -> list[dict[str, Any]]:
    messages = []
    for i, msg in enumerate(body.messages):
        out: dict[str, Any] = {
            "role": "system" if msg.role == "developer" else msg.role,
            "content": _message_text(msg.content, i, images),
        }
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(msg, key) is not None:
                out[key] = getattr(msg, key)
        messages.append(out)
    return messages


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    ids: list[int]
    images: PromptImages | None = None


async def render_chat(
    engine: ModelEngine,
    messages: list[dict[str, Any]],
    *,
    renderer: RenderPool,
    timeout_s: float,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    images: ImageSink | None = None,
) -> RenderedPrompt:
    """The model's chat template over OpenAI-style messages (role, content, tool_calls...),
    rendered and tokenized on the render pool; a render past ``timeout_s`` is stopped (400)."""
    vision = engine.loaded.vision
    if vision is not None and vision.family.instruction_turn:
        text, images = _instruction_text(engine, messages, images, tools)
        return await _with_images(engine, text, images, renderer)
    tokenizer = engine.tokenizer
    render = partial(_chat_text, tokenizer, messages, tools, template_kwargs or {})
    try:
        text, templated = await renderer.run(render, timeout_s)
    except TimeoutError:
        raise InvalidRequestError(
            f"the chat template took longer than {timeout_s:g} s to render; the template of "
            f"'{engine.name}' loops too long for these messages (server.template_timeout_s "
            "sets the limit)",
            param="messages",
            code="chat_template_timeout",
        ) from None
    if images is not None and images.parts:
        return await _with_images(engine, text, images, renderer)
    # Native code that ends on its own; the body size limit bounds it.
    if templated:  # the template wrote the special tokens already
        encode = partial(tokenizer.encode, text, add_special_tokens=False)
    else:
        encode = partial(tokenizer.encode, text)
    return RenderedPrompt(text, list(await renderer.run(encode)))


async def _with_images(
    engine: ModelEngine, text: str, images: ImageSink, renderer: RenderPool
) -> RenderedPrompt:
    """A prompt with images: each stands in the text as the model's image token, and
    the model's processor expands it to the image's tokens."""
    vision = engine.loaded.vision
    if vision is None:
        where = images.parts[0].where
        raise InvalidRequestError(
            f"{where}: model '{engine.name}' is a text model and does not take images; "
            "send text parts only, or use a vision model (kind vlm in /v1/models)",
            param=where,
        )
    most = vision.family.max_images
    if most is not None and len(images.parts) > most:
        where = images.parts[most].where
        raise InvalidRequestError(
            f"{where}: model '{engine.name}' ({engine.loaded.info.model_type}) takes at most "
            f"{most} image(s) per request (this one has {len(images.parts)})",
            param=where,
        )
    await fetch_images(images)
    text = vision.with_image_text(text, images.marker)
    run = partial(
        process, vision.processor, text, images.parts, vision.image_token_id, vision.prompt_ids
    )
    ids, pixels = await renderer.run(run)
    return RenderedPrompt(text, ids, pixels)


def _instruction_text(
    engine: ModelEngine,
    messages: list[dict[str, Any]],
    images: ImageSink | None,
    tools: list[dict[str, Any]] | None,
) -> tuple[str, ImageSink]:
    """The one user message's text (and its images) for a processor that writes its own
    instruction turn around it (Family.instruction_turn), as mlx-vlm's generate gives it
    the prompt; a conversation it cannot take is a 400 saying what to send."""
    family = engine.loaded.info.model_type
    rule = (
        f"model '{engine.name}' ({family}) answers one user message with at least one "
        "image: its processor writes the model's one instruction turn around that "
        "message's text, its images first, and has no chat template for "
    )
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise InvalidRequestError(
            rule + "other roles or earlier turns; send the request as one user message",
            param="messages",
        )
    if images is None or not images.parts:
        raise InvalidRequestError(
            rule + "text alone; add an image (or use /v1/completions for plain text)",
            param="messages",
        )
    if tools:
        raise InvalidRequestError(rule + "tools; send the request without tools", param="tools")
    return str(messages[0]["content"]), images


def _chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
) -> tuple[str, bool]:
    """The prompt text, and whether a chat template made it (runs on the render pool)."""
    if not getattr(tokenizer, "chat_template", None):
        # No template: a plain transcript the base model can continue.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return text, False
    kwargs = dict(template_kwargs)
    if tools and "tools" in str(tokenizer.chat_template):
        kwargs["tools"] = tools
    elif tools and tool_format(tokenizer) in HERMES_FORMATS:
        messages = with_hermes_tools(messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:  # jinja raises its own errors for bad conversations
        raise InvalidRequestError(
            f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return text, True


_HERMES_TOOLS = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def with_hermes_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Tools told in the system message, and past calls written into the assistant
    text, in the Hermes format (the one output_parser reads by default): for chat
    templates that do not render tools themselves."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = _HERMES_TOOLS.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{system}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": system})
    for message in out:
        calls = message.pop("tool_calls", None) or []
        written = [_hermes_call(call) for call in calls]
        if written:
            message["content"] = "\n".join([message["content"] or "", *written]).lstrip()
    return out


def _hermes_call(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    # A client's malformed arguments are shown as they came.
    with contextlib.suppress(json.JSONDecodeError):
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


async def completion_prompt_ids(
    engine: ModelEngine, body: CompletionRequest, renderer: RenderPool
) -> list[list[int]]:
    """The prompts' token ids, on the render pool: a prompt can be 32 MiB of text or ids."""
    vocab = engine.loaded.vocab_size
    return await renderer.run(partial(_prompt_ids, engine.tokenizer, vocab, body.prompt))


def _prompt_ids(tokenizer: Any, vocab: int, prompt: PromptField) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [list(tokenizer.encode(prompt))]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [list(tokenizer.encode(p)) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
    if not prompts:
        raise InvalidRequestError("'prompt' must not be empty", param="prompt")
    for ids in prompts:
        if not ids:
            raise InvalidRequestError("'prompt' must not be empty", param="prompt")
        bad = next((t for t in ids if t < 0 or (vocab and t >= vocab)), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} in 'prompt' is outside the vocabulary (0..{vocab - 1})",
                param="prompt",
            )
    return prompts


async def decoded_prompts(
    engine: ModelEngine, prompts: list[list[int]], renderer: RenderPool
) -> list[str]:
    """The prompts as text (for ``echo``), decoded on the render pool."""
    decode = engine.tokenizer.decode
    return await renderer.run(lambda: [decode(ids) for ids in prompts])


def openai_sampling(body: ChatCompletionRequest | CompletionRequest) -> SamplingRequest:
    """What an OpenAI body says about sampling."""
    return SamplingRequest(
        max_tokens=body.requested_max_tokens(),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs_wanted(),
        speculative=body.speculative,
    )


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """What any API's request body says about sampling (None: not given)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Alternatives per token with logprobs (None: no logprobs).
    logprobs: int | None = None
    # The name of the max-tokens field in this API, for error messages.
    max_tokens_param: str = "max_tokens"
    # The field holding the prompt, and what else would help, for error messages.
    prompt_param: str = "messages"
    hint: str = ""
    # False: the request opted out of speculative decoding.
    speculative: bool = True
    # A window smaller than the model's the request asks for (Ollama's num_ctx).
    context_limit: int | None = None


def build_sampling(
    engine: ModelEngine,
    max_tokens: int,
    req: SamplingRequest,
    defaults: SamplingSettings,
    forced: frozenset[str] = frozenset(),
) -> SamplingParams:
    """Request values over defaults (except ``forced`` fields, where the defaults
    win); ``max_tokens`` is the request's output budget (output_budget.py)."""
    stop_ids = set(req.stop_token_ids)
    if not req.ignore_eos:
        stop_ids |= engine.loaded.eos_token_ids

    def pick(field: str) -> Any:
        value = getattr(req, field)
        return getattr(defaults, field) if value is None or field in forced else value

    return SamplingParams(
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k"),
        min_p=pick("min_p"),
        repetition_penalty=pick("repetition_penalty"),
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stop,
        stop_token_ids=frozenset(stop_ids),
        logprobs=req.logprobs,
        speculative=req.speculative,
    )


def make_request(
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    grammar: Any = None,
    images: PromptImages | None = None,
) -> Request:
    return Request(request_id, tuple(prompt_ids), sampling, grammar, images=images)


def choice_requests(
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    grammar: Any,
    n: int,
    images: PromptImages | None = None,
) -> list[Request]:
    """``n`` sequences of one prompt (choices 0..n-1), started together so they share
    its prefill; with a seed, choice i samples with seed + i so the choices differ."""
    if n == 1:
        return [make_request(request_id, prompt_ids, sampling, grammar, images)]
    return [
        make_request(
            f"{request_id}-{i}",
            prompt_ids,
            sampling
            if sampling.seed is None
            else dataclasses.replace(sampling, seed=sampling.seed + i),
            grammar,
            images,
        )
        for i in range(n)
    ]
