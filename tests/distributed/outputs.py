"""What the split and the one-process servers are asked, the same way."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

# A JSON schema for structured output (a grammar on rank 0, its masks on every rank).
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
PROMPTS = [
    "the cat sat on the mat and",
    "once upon a time there was",
    "hello world, my name is",
    "a b c d e f g",
]


def greedy(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 24) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def streamed(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 24) -> str:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def concurrent_streams(client: openai.OpenAI, model: str, max_tokens: int = 24) -> list[str]:
    """Every prompt streamed at once (they share the decode batch)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: streamed(client, model, p, max_tokens), PROMPTS))


def seeded(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=16,
        temperature=0.9,
        seed=1234,
    )
    return reply.choices[0].message.content or ""


def with_usage(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[str, int, int]:
    """(greedy answer, prompt tokens, prompt tokens served from the prefix cache)."""
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].message.content or "", usage.prompt_tokens, cached


def constrained(client: openai.OpenAI, model: str, **kw: object) -> tuple[str, str]:
    """(answer, finish reason) of a request whose output must follow SCHEMA."""
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer please."}],
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "t", "schema": SCHEMA, "strict": True},
        },
        **{"temperature": 0, **kw},  # type: ignore[arg-type]
    )
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def follows_schema(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True
