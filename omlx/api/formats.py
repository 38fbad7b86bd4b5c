"""OpenAI response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from omlx.engine.stream import StreamEvent


@dataclass(slots=True)
class Choice:
    """One generated choice as it accumulates."""

    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, event: StreamEvent) -> None:
        self.text += event.text
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens


def usage_of(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    output = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Format:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, num_choices: int):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(num_choices)]
        self._started = [False] * num_choices

    def _envelope(self, object_name: str, **fields: Any) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            **fields,
        }

    def chunk(self, index: int, event: StreamEvent) -> dict[str, Any] | None:
        """Record the event; the stream chunk to send for it, if any."""
        self.choices[index].add(event)
        first = not self._started[index]
        self._started[index] = True
        choice = self._chunk_choice(index, event, first)
        if choice is None:
            return None
        return self._envelope(self.chunk_object_name, choices=[choice])

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, choices=[], usage=usage_of(self.choices))

    def body(self) -> dict[str, Any]:
        return self._envelope(
            self.object_name,
            usage=usage_of(self.choices),
            choices=[self._final_choice(i, c) for i, c in enumerate(self.choices)],
        )

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict | None:
        raise NotImplementedError

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict | None:
        if first:  # the first chunk announces the role
            delta: dict[str, Any] = {"role": "assistant", "content": event.text}
        elif event.text:
            delta = {"content": event.text}
        elif event.finish_reason:
            delta = {}
        else:
            return None
        return {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": event.finish_reason,
        }

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return {
            "index": index,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "message": {"role": "assistant", "content": choice.text},
        }


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, response_id: str, model: str, echoes: list[str]):
        super().__init__(response_id, model, len(echoes))
        self._echoes = echoes

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict | None:
        text = (self._echoes[index] if first else "") + event.text
        if not text and not event.finish_reason:
            return None
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": event.finish_reason,
        }

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": self._echoes[index] + choice.text,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }
