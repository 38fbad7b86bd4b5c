"""One model's view of the prefix cache. MLX thread only.

``lookup`` restores the longest cached prefix of a prompt as a prompt cache
(which blocks: ``prefix_index.PrefixIndex.match``, pure, also asked by admission
through ``match``); ``store`` turns a request's cache into block payloads for
the hot tier (which writes them to the SSD tier by its mode).

A model split across ranks (omlx serve --distributed) has a PrefixCache per rank,
each holding its own KV shard under the same block keys; ``lookup_together`` cuts
each hit to a length every rank restored (their tiers evict on their own).

Models with recurrent layers, sliding windows or chunked attention (see kv_codec) need the
state at a block's end; ``snapshot`` records it during prefill, keyed by
request id, and ``forget`` drops a request's snapshots once it has stored (or
left). A block whose end has no snapshot (e.g. output tokens decoded in the
batch) is not stored, nor any block after it: a wrong state is never stored.
Snapshots live in memory only, so nothing of a forgotten request can reach
the disk afterwards. A snapshot can be large (a recurrent state, or a whole
window per rotating layer), so the runner stores each block as its snapshot
is taken: a prefill holds only its newest one outside the hot tier's budget.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omlx.cache import kv_codec
from omlx.cache.blocks import block_keys, chain_key
from omlx.cache.hot import ClearTier, HotTier
from omlx.cache.kv_bytes import cut_payload
from omlx.cache.prefix_index import NO_HIT, HitSpan, PrefixIndex, PrefixMatch
from omlx.cache.safetensors_io import BlockPayload
from omlx.cache.ssd import PUT_TIMEOUT_S as SSD_PUT_TIMEOUT_S
from omlx.cache.ssd import SSDStore
from omlx.cache.weights_digest import weights_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheHit:
    layers: list[Any]  # a prompt cache holding ``num_tokens`` tokens
    num_tokens: int


@dataclass(slots=True)
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    blocks_stored: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.misses,
            "tokens_saved": self.tokens_saved,
            "blocks_stored": self.blocks_stored,
        }


# A model split across ranks: each rank's spans of the same prompts' hits in, the length
# every rank holds out, per prompt (a collective: omlx/distributed/shared_hits.py).
AgreeHits = Callable[[list[HitSpan]], list[int]]


def model_identity(name: str, path: Path, digests: Path | None) -> str:
    """The model's name plus a digest of what decides its KV values: the config
    and the weight files' names and contents (models/weights_digest.py; their
    hashes kept in ``digests``). Other weights, even of the same sizes -> other
    blocks; the old ones age out (the SSD store drops them when it opens)."""
    digest = hashlib.blake2b(digest_size=8)
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    digest.update(weights_digest(path, digests).encode())
    return f"{name}@{digest.hexdigest()}"


class PrefixCache:
    def __init__(
        self,
        identity: str,
        layout: tuple[str, ...],
        block_size: int,
        hot: HotTier,
        ssd: SSDStore | None,
    ):
        self.identity = identity
        self.layout = layout
        self.block_size = block_size
        self.sliceable = kv_codec.is_sliceable(layout)
        self._hot = hot
        self._ssd = ssd
        self.index = PrefixIndex(
            identity,
            block_size,
            sliceable=self.sliceable,
            has_block=lambda key: hot.contains(identity, key),
        )
        # request id -> {token position: non-KV state right after it}
        self._snapshots: dict[str, dict[int, kv_codec.Snapshot]] = {}
        self._stats = PrefixStats()
        self._stats_lock = threading.Lock()
        hot.attach(identity, ssd)

    @property
    def needs_snapshots(self) -> bool:
        return not self.sliceable

    # -- lookup ------------------------------------------------------------

    def match(self, prompt_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
        """Prompt tokens a lookup would serve now (no block is read)."""
        return self.index.match(prompt_ids, extra_keys).num_tokens

    def lookup(
        self,
        prompt_ids: Sequence[int],
        template: list[Any],
        *,
        room: bool = True,
        extra_keys: tuple[str, ...] = (),
    ) -> CacheHit | None:
        """The longest cached prefix of ``prompt_ids[:-1]``, restored into ``template``
        (a new prompt cache), or None on a miss. ``room``: see ``kv_codec.restore``.
        ``extra_keys``: what else the tokens' cache depends on (image hashes)."""
        payloads = self._payloads(self.index.match(prompt_ids, extra_keys))
        return self._counted(self._restore(payloads, template, room))

    def lookup_together(
        self,
        prompts: Sequence[Sequence[int]],
        new_cache: Callable[[], list[Any]],
        *,
        room: bool,
        agree: AgreeHits | None = None,
    ) -> list[CacheHit | None]:
        """``lookup`` of each prompt (``new_cache()``: a fresh prompt cache). ``agree``
        (the model split across ranks, every rank looking up the same prompts): each
        hit is cut to a length every rank restored, so the ranks' caches stay in step
        whatever each one's tiers lost."""
        found = [self._payloads(self.index.match(p)) for p in prompts]
        hits = [self._restore(payloads, new_cache(), room) for payloads in found]
        if agree is not None:
            lengths = agree([self._span(p, h) for p, h in zip(found, hits, strict=True)])
            hits = [
                self._cut(length, payloads, hit, new_cache, room)
                for length, payloads, hit in zip(lengths, found, hits, strict=True)
            ]
        return [self._counted(hit) for hit in hits]

    def _restore(
        self, payloads: list[BlockPayload], template: list[Any], room: bool
    ) -> CacheHit | None:
        if not payloads:
            return None
        num_tokens = sum(p.num_tokens for p in payloads)
        try:
            layers = kv_codec.restore(
                template, [p.tensors for p in payloads], num_tokens, room=room
            )
        except (KeyError, ValueError) as exc:  # a block that does not fit this model
            log.warning("prefix cache: cannot restore %d blocks: %s", len(payloads), exc)
            return None
        return CacheHit(layers, num_tokens)

    def _counted(self, hit: CacheHit | None) -> CacheHit | None:
        with self._stats_lock:
            self._stats.lookups += 1
            if hit is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
                self._stats.tokens_saved += hit.num_tokens
        return hit

    def _span(self, payloads: list[BlockPayload], hit: CacheHit | None) -> HitSpan:
        """The lengths this hit can be cut to (``prefix_index.HitSpan``)."""
        if hit is None:
            return NO_HIT
        total = hit.num_tokens
        if self.sliceable:
            return HitSpan(1, total, total)
        last = payloads[-1].num_tokens
        return HitSpan(self.block_size, total if last == self.block_size else total - last, total)

    def _cut(
        self,
        num_tokens: int,
        payloads: list[BlockPayload],
        hit: CacheHit | None,
        new_cache: Callable[[], list[Any]],
        room: bool,
    ) -> CacheHit | None:
        """``hit`` restored again at ``num_tokens`` (one of its span's lengths)."""
        if hit is None or num_tokens == hit.num_tokens:
            return hit
        kept, held = [], 0
        for payload in payloads:
            if held >= num_tokens:
                break
            if held + payload.num_tokens > num_tokens:  # sliceable KV only (the span)
                payload = cut_payload(payload, num_tokens - held)
            kept.append(payload)
            held += payload.num_tokens
        return self._restore(kept, new_cache(), room)

    def _payloads(self, found: PrefixMatch) -> list[BlockPayload]:
        """The matched blocks, read from the tiers, up to the first one that left
        them since the match; a block served in part is cut to its first tokens."""
        payloads = []
        # The promotions' write-backs of one hit wait once for a full SSD queue, not
        # once per block (the MLX thread, and so every model, waits with them).
        deadline = time.monotonic() + SSD_PUT_TIMEOUT_S
        for key in found.keys:
            payload = self._hot.get(self.identity, key, deadline_s=deadline)
            if payload is None:
                break
            payloads.append(payload)
        if payloads and len(payloads) == len(found.keys) and found.cut:
            payloads[-1] = cut_payload(payloads[-1], found.cut)
        return payloads

    # -- store -------------------------------------------------------------

    def snapshot(self, request_id: str, position: int, layers: Sequence[Any]) -> None:
        """Record the non-KV state (recurrent, sliding window) right after token
        ``position - 1``."""
        since = position - (position - 1) % self.block_size - 1  # the block's first token
        self._snapshots.setdefault(request_id, {})[position] = kv_codec.snapshot(layers, since)

    def snapshot_positions(self, request_id: str) -> list[int]:
        return sorted(self._snapshots.get(request_id, {}))

    def forget(self, request_id: str) -> None:
        self._snapshots.pop(request_id, None)

    def store(
        self,
        request_id: str,
        token_ids: Sequence[int],
        layers: Sequence[Any],
        num_tokens: int,
        *,
        tail: bool,
        extra_keys: tuple[str, ...] = (),
    ) -> int:
        """Store the full blocks of the first ``num_tokens`` tokens held by ``layers``
        (and, with ``tail``, the partial block after them). Returns blocks written.

        The request's snapshots up to ``num_tokens`` are released: their blocks are
        stored now (or were already), and a window snapshot is large. A later store
        of the same request stops at a block that is no longer cached."""
        snaps = self._snapshots.get(request_id, {})
        try:
            return self._store_chain(token_ids, layers, num_tokens, tail, snaps, extra_keys)
        finally:
            for position in [p for p in snaps if p <= num_tokens]:
                del snaps[position]

    def _store_chain(
        self,
        token_ids: Sequence[int],
        layers: Sequence[Any],
        num_tokens: int,
        tail: bool,
        snaps: dict[int, kv_codec.Snapshot],
        extra_keys: tuple[str, ...] = (),
    ) -> int:
        size = self.block_size
        stored = 0
        parent = self.index.root_for(extra_keys)
        # This runs on the MLX thread: a saturated SSD queue may hold it up once
        # per store, not once per block (later blocks then drop, counted).
        deadline = time.monotonic() + SSD_PUT_TIMEOUT_S
        keys = block_keys(self.identity, token_ids[:num_tokens], size, extra_keys)
        for i, key in enumerate(keys):
            written = self._put(key, i * size, (i + 1) * size, layers, snaps, deadline)
            if written is None:
                return stored
            self.index.remember(parent, key, token_ids[i * size : (i + 1) * size])
            stored += written
            parent = key
        end = len(keys) * size
        if tail and num_tokens > end:
            key = chain_key(parent, token_ids[end:num_tokens])
            written = self._put(key, end, num_tokens, layers, snaps, deadline)
            if written is not None:
                self.index.remember(parent, key, token_ids[end:num_tokens])
            stored += bool(written)
        return stored

    def _put(
        self,
        key: bytes,
        start: int,
        end: int,
        layers: Sequence[Any],
        snaps: dict[int, kv_codec.Snapshot],
        deadline_s: float,
    ) -> bool | None:
        """Put one block unless it is there already (False). None when it cannot be
        made (no snapshot at its end), which ends the chain."""
        hex_key = key.hex()
        if self._hot.contains(self.identity, hex_key):
            return False
        state = None
        if not self.sliceable:
            state = snaps.get(end)
            if state is None:
                return None
        tensors = kv_codec.block_tensors(layers, start, end, state)
        payload = BlockPayload(
            hex_key, self.identity, end - start, self.block_size, self.layout, tensors
        )
        self._hot.put(payload, deadline_s=deadline_s)
        with self._stats_lock:
            self._stats.blocks_stored += 1
        return True

    # -- admin -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            out: dict[str, Any] = self._stats.as_dict()
        out["ssd"] = asdict(self._ssd.stats()) if self._ssd is not None else None
        return out

    def clear(self, tier: ClearTier) -> None:
        """Drop this model's blocks from its tiers (``HotTier.clear``)."""
        self._hot.clear(self.identity, tier=tier)

    def close(self) -> None:
        """Detach from the hot tier (write-back flushes to the SSD) and close the store."""
        self._snapshots.clear()
        self.index.clear()
        self._hot.detach(self.identity)
        if self._ssd is not None:
            self._ssd.close()
