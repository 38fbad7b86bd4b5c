"""What the runner owes the prefix cache: a request's prompt blocks once its first
token is out, and every block it holds when it leaves (a model whose caches need
snapshots: also each finished block during an unbatched prefill).

Stores wait for the start of the next step, after the events of this one went
out, so they never add to a request's time to first token. MLX thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from omlx.cache.hot import ClearTier
from omlx.cache.prefix import PrefixCache
from omlx.scheduler import Request, TokenOutput

log = logging.getLogger(__name__)

# A request's cache layers and how many tokens they hold (-1: all it was fed).
Held = tuple[list[Any], int]


@dataclass(slots=True)
class _Record:
    """One request's tokens as its cache holds them: the prompt, then its output."""

    tokens: list[int]
    num_prompt_tokens: int
    # A prompt's images' hashes: its blocks' extra keys.
    extra_keys: tuple[str, ...] = ()


@dataclass(slots=True)
class PromptStores:
    """``layers_of(request_id)``: the request's live cache layers (None when it has
    none now). Without a prefix cache, nothing is tracked and nothing stored."""

    prefix: PrefixCache | None
    layers_of: Callable[[str], list[Any] | None]
    _records: dict[str, _Record] = field(default_factory=dict)
    _pending: list[Callable[[], None]] = field(default_factory=list)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def track(self, request: Request, extra_keys: tuple[str, ...] = ()) -> None:
        if self.prefix is not None:
            tokens = list(request.prompt_ids)
            self._records[request.request_id] = _Record(tokens, len(tokens), extra_keys)

    def boundary_hook(self, request: Request) -> Callable[[int, list[Any]], None] | None:
        """What an unbatched prefill of ``request`` does at each block boundary when
        the model's caches need snapshots (None: they do not): snapshot, and store
        the finished blocks now, since each snapshot (a recurrent state or a whole
        window per layer) would otherwise stay in RAM outside every budget until the
        prompt ends; the hot tier's bytes are budgeted. (Full blocks only: the
        prompt's tail snapshot waits for the last store.)"""
        prefix = self.prefix
        if prefix is None or not prefix.needs_snapshots:
            return None
        rid, prompt, size = request.request_id, request.prompt_ids, prefix.block_size
        record = self._records.get(rid)
        keys = record.extra_keys if record is not None else ()  # an image prompt's

        def hook(position: int, layers: list[Any]) -> None:
            try:
                prefix.snapshot(rid, position, layers)
                end = position - position % size
                prefix.store(rid, prompt, layers, end, tail=False, extra_keys=keys)
            except Exception:  # as in ``run``: never fail the prefill over the cache
                log.exception("prefix cache snapshot or store failed")

        return hook

    def note(self, outputs: Iterable[TokenOutput]) -> None:
        """Record produced tokens; a request's first one means its prompt is cached."""
        for out in outputs:
            record = self._records.get(out.request_id)
            if record is None:
                continue
            if len(record.tokens) == record.num_prompt_tokens:
                self._later(self._store_prompt, out.request_id, record.num_prompt_tokens)
            record.tokens.append(out.token_id)

    def leave(self, request_id: str, held: Held | None) -> None:
        """The request left; what its cache ``held`` goes to the prefix cache."""
        record = self._records.pop(request_id, None)
        if self.prefix is not None:
            self._later(self._store_and_forget, request_id, record, held)

    def run(self) -> None:
        """The stores waiting since the last step, now."""
        pending, self._pending = self._pending, []
        for store in pending:
            try:
                store()
            except Exception:  # the cache is an optimisation: never fail a request over it
                log.exception("prefix cache store failed")

    def clear(self, tier: ClearTier) -> None:
        """Drop this model's blocks from the cache's tiers, the pending ones included."""
        self.run()
        if self.prefix is not None:
            self.prefix.clear(tier)

    def reset(self) -> None:
        """Forget every request (after an MLX error left the batch unusable)."""
        if self.prefix is not None:
            for request_id in self._records:
                self.prefix.forget(request_id)
        self._records.clear()
        self._pending.clear()

    def _later(self, store: Callable[..., None], *args: Any) -> None:
        self._pending.append(lambda: store(*args))

    def _store_prompt(self, request_id: str, num_prompt_tokens: int) -> None:
        """The prompt's blocks, including the partial tail before its last token."""
        record = self._records.get(request_id)
        layers = self.layers_of(request_id)
        if layers is None or record is None or self.prefix is None:
            return
        self.prefix.store(
            request_id,
            record.tokens,
            layers,
            num_prompt_tokens - 1,
            tail=True,
            extra_keys=record.extra_keys,
        )

    def _store_and_forget(self, request_id: str, record: _Record | None, held: Held | None) -> None:
        assert self.prefix is not None
        try:
            if record is not None and held is not None:
                layers, num_cached = held
                tokens = record.tokens
                num = min(num_cached, len(tokens)) if num_cached >= 0 else len(tokens)
                # With the partial tail: a next turn reuses the answer's last tokens too.
                self.prefix.store(
                    request_id, tokens, layers, num, tail=True, extra_keys=record.extra_keys
                )
        finally:
            self.prefix.forget(request_id)
