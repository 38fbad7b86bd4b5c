"""Batched prefill and the batched decode step. MLX thread only.

Built on mlx-lm's public pieces: ``PromptProcessingBatch`` prefills several
prompts in one right-padded forward per chunk, and the batched caches
(``BatchKVCache`` and friends, via each cache type's ``merge``/``extend``/
``extract``/``filter``) hold the decoding sequences. The decode step itself is
ours: it samples from the raw logits (a log-softmax over the vocabulary runs
only for the rows that asked for logprobs, in one op) and, on the CPU backend, hands each
step's tokens out at the end of that same step. mlx-lm's BatchGenerator hands
them out one call later, after queuing the next forward, which on a GPU costs
nothing but on the CPU backend delays every token, a first token included, by
most of a step (``async_eval`` there returns only once the forward is nearly
done).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from omlx.engine.batch_cache import columns
from omlx.engine.compiled_batch import CompiledBatchStep
from omlx.engine.draft_model import DraftProposer
from omlx.engine.logprobs import PendingLogprobs, pending_logprobs
from omlx.engine.ngram import NgramDrafter
from omlx.engine.processor_context import processor_context
from omlx.engine.row_layout import RowLayouts
from omlx.engine.speculative import SpecStats, verify_rows
from omlx.engine.strategy import ExecutionStrategy
from omlx.mlx_types import BatchCacheLayer, CacheLayer, LanguageModel, int_list
from omlx.scheduler import TokenLogprob, TokenOutput

if TYPE_CHECKING:
    import mlx.nn as nn

Sampler = Callable[[mx.array], mx.array]

# Free MLX's buffer cache now and then, as mlx-lm's generation loops do.
_CLEAR_EVERY = 512


# Positions a speculative forward may verify across its rows. On the CPU backend a
# forward's cost grows with its positions past a few (a 5-wide step of one row
# pays, of eight rows loses: benchmarks/README.md, "bench_speculative.py"); a GPU
# verifies many at nearly the cost of one (not measured here).
VERIFY_POSITIONS = {"cpu": 10, "gpu": 64}


def verify_width(positions: int) -> int:
    """The forward width for ``positions`` per row: 2, 3, 5, 9, 17 (few shapes:
    each new one costs a kernel build on MLX's CPU backend the first time)."""
    width = 2
    while width < positions:
        width = 2 * width - 1
    return width


@dataclass(slots=True)
class Row:
    """One sequence of a batch: how to sample it and what its processors see."""

    request_id: str
    sampler: Sampler
    processors: list[Any]
    # Every token fed so far (the processors' context); kept only with processors.
    context: mx.array | None = field(default=None)
    # Top alternatives wanted with each token's logprob (None: no logprobs).
    logprobs: int | None = None
    # Proposes the row's next tokens from its prompt and output (None: it never
    # speculates: opted out, or it wants logprobs).
    drafter: NgramDrafter | None = None
    # The logits a draft model drew this step's drafts from (None: point masses).
    draft_logits: mx.array | None = None

    @classmethod
    def make(
        cls,
        request_id: str,
        sampler: Sampler,
        processors: list[Any],
        fed: Sequence[int],
        logprobs: int | None = None,
        drafter: NgramDrafter | None = None,
    ) -> Row:
        context = processor_context(fed) if processors else None
        return cls(request_id, sampler, processors, context, logprobs, drafter)

    @property
    def greedy(self) -> bool:
        return not hasattr(self.sampler, "scaled")

    def remember(self, fed: mx.array | None) -> mx.array | None:
        if self.processors and fed is not None:
            ctx = self.context
            self.context = fed if ctx is None else mx.concatenate([ctx, fed])
        return self.context


@dataclass(frozen=True, slots=True)
class AskedLogprobs:
    """The logprobs of one step's rows that asked (lazy until handed out)."""

    request_ids: list[str]
    ks: list[int]
    pending: PendingLogprobs

    def resolve(self, token_of: dict[str, int]) -> dict[str, TokenLogprob]:
        """Python values by request id, for the rows still in ``token_of``."""
        tokens = [token_of.get(rid, 0) for rid in self.request_ids]
        values = self.pending.to_python(tokens, self.ks)
        return {rid: v for rid, v in zip(self.request_ids, values, strict=True) if rid in token_of}


def asked_logprobs(
    rows: Sequence[Row], logits: mx.array, sampled: mx.array
) -> AskedLogprobs | None:
    """Logprobs for the rows that asked: one log-softmax and top-k over just those
    rows (None when no row asked: the others pay nothing)."""
    asking = [e for e, row in enumerate(rows) if row.logprobs is not None]
    if not asking:
        return None
    if len(asking) < len(rows):
        picked = mx.array(asking)
        logits, sampled = logits[picked], sampled[picked]
    ks = [rows[e].logprobs or 0 for e in asking]
    pending = pending_logprobs(logits, sampled, max(ks))
    return AskedLogprobs([rows[e].request_id for e in asking], ks, pending)


def merges(cache: list[CacheLayer]) -> bool:
    """Whether every layer of a sequence's cache can join a batch's (mlx-lm's
    ChunkedKVCache cannot; nor mlx-vlm's own classes, Family.own_cache: their merge
    makes mlx-vlm's batch classes, whose forward is not the lone sequence's)."""
    return all(
        hasattr(layer, "merge") and not type(layer).__module__.startswith("mlx_vlm.")
        for layer in cache
    )


def merge_caches(caches: Sequence[list[CacheLayer]]) -> list[BatchCacheLayer]:
    """Per-sequence prompt caches (one list of layers each) as one batched cache."""
    batched = []
    for i, layer in enumerate(caches[0]):
        if not hasattr(layer, "merge"):
            raise ValueError(f"a {type(layer).__name__} cache cannot be batched")
        batched.append(layer.merge([c[i] for c in caches]))
    return batched


def _others(size: int, taken: list[int]) -> list[int]:
    """The indices below ``size`` not in ``taken``, in order."""
    skip = set(taken)
    return [i for i in range(size) if i not in skip]


class PrefillBatch:
    """Prompts prefilled together, a chunk of each per step, all but each
    prompt's last token: that one goes through the decode step, which samples
    the first token from it."""

    def __init__(self, model: LanguageModel, step_size: int):
        self._model = model
        self._step = step_size
        self._batch: PromptProcessingBatch | None = None
        self.rows: list[Row] = []
        self._left: list[list[int]] = []  # still to prefill
        self._last: list[int] = []  # the last prompt token, fed by the decode step
        self._num_cached: list[int] = []  # tokens in the row's cache
        # The memory gate's cap on the next chunk of every row (None: none; 0: wait).
        self._cap: int | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Row, cache: list[CacheLayer], num_cached: int, rest: Sequence[int]) -> None:
        """``cache`` holds ``num_cached`` tokens; ``rest`` (>= 2 tokens) follows them."""
        if len(rest) < 2:
            raise ValueError("a prefill row needs at least two tokens (use the decode batch)")
        # Sampling happens in the decode step: the batch's own per-row lists stay
        # placeholders (kept one per row, as its filter expects).
        piece = PromptProcessingBatch(
            cast("nn.Module", self._model),  # mlx-lm types its model as nn.Module
            [0],
            [cache],
            prefill_step_size=self._step,
            samplers=[None],  # type: ignore[list-item]  # mlx-lm takes None (its fallback)
            logits_processors=[[]],
        )
        if self._batch is None:
            self._batch = piece
        else:
            self._batch.extend(piece)
        self.rows.append(row)
        self._left.append(list(rest[:-1]))
        self._last.append(rest[-1])
        self._num_cached.append(num_cached)

    def plan(self) -> list[tuple[str, int, int, int]]:
        """(request id, tokens the next chunk feeds, prompt tokens not yet in the
        cache, the whole prompt) per row."""
        return [
            (row.request_id, min(self._step, len(left)), len(left) + 1, cached + len(left) + 1)
            for row, left, cached in zip(self.rows, self._left, self._num_cached, strict=True)
        ]

    def cap_next_chunk(self, cap: int | None) -> None:
        """The memory gate's cap on the next chunk: on every row, since rows are
        right-padded to the longest in one forward (0: the batch waits a step)."""
        self._cap = cap

    def step(self) -> tuple[list[tuple[Row, int]], list[BatchCacheLayer]]:
        """One chunk of every row. Returns the rows whose prompt is in now (with
        their last prompt token) and their batched cache."""
        if self._batch is None or not self.rows or self._cap == 0:
            return [], []
        step = min(self._step, self._cap or self._step)
        sizes = [min(step, len(left)) for left in self._left]
        chunks = [left[:n] for left, n in zip(self._left, sizes, strict=True)]
        self._left = [left[n:] for left, n in zip(self._left, sizes, strict=True)]
        self._num_cached = [c + n for c, n in zip(self._num_cached, sizes, strict=True)]
        for row, chunk in zip(self.rows, chunks, strict=True):
            if row.processors:
                row.remember(processor_context(chunk))
        self._batch.prompt(chunks)
        done = [i for i, left in enumerate(self._left) if not left]
        if not done:
            return [], []
        finished = [(self.rows[i], self._last[i]) for i in done]
        if len(done) == len(self.rows):
            cache = self._batch.prompt_cache
            self._clear()
            return finished, cache
        cache = merge_caches([self._batch.extract_cache(i) for i in done])
        self._keep(_others(len(self.rows), done))
        return finished, cache

    def remove(
        self, request_ids: set[str], *, extract: bool
    ) -> dict[str, tuple[list[CacheLayer], int] | None]:
        """Take rows out; with ``extract``, returns each one's cache and the tokens
        it holds (None for each without)."""
        gone = [i for i, row in enumerate(self.rows) if row.request_id in request_ids]
        if not gone or self._batch is None:
            return {}
        batch = self._batch
        out = {
            self.rows[i].request_id: (
                (batch.extract_cache(i), self._num_cached[i]) if extract else None
            )
            for i in gone
        }
        self._keep(_others(len(self.rows), gone))
        return out

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self._clear()
            return
        assert self._batch is not None
        self._batch.filter(keep)
        self.rows = [self.rows[i] for i in keep]
        self._left = [self._left[i] for i in keep]
        self._last = [self._last[i] for i in keep]
        self._num_cached = [self._num_cached[i] for i in keep]

    def _clear(self) -> None:
        self._batch = None
        self.rows, self._left, self._last, self._num_cached = [], [], [], []


class DecodeBatch:
    """Sequences past their prompt: one forward for all of them per step.

    ``pipelined`` (the GPU default): queue the next forward before handing out
    this step's tokens, as mlx-lm does, so the device never waits on Python; the
    tokens then leave one step after they were sampled. Off (the CPU default),
    each step's tokens leave at its end.
    """

    def __init__(
        self,
        model: LanguageModel,
        strategy: ExecutionStrategy,
        compiled: CompiledBatchStep | None = None,
    ):
        self._model = model
        self._compiled = compiled
        self._pipelined = strategy.pipelined
        self.rows: list[Row] = []
        self._cache: list[BatchCacheLayer] = []
        # What each row feeds next, and whether it is a sampled token not handed out.
        self._feed: mx.array | None = None
        self._fresh: list[bool] = []
        # The logprobs of the tokens in ``_feed`` (pipelined: handed out next step).
        self._feed_logprobs: AskedLogprobs | None = None
        self._num_steps = 0
        # Rows joined since the last step (whose first tokens it samples).
        self._joined = False
        # Speculative decoding: tokens each row may draft per step (0: off), and
        # where each row's tokens sit after steps that rows accepted unevenly.
        self.num_draft = 0
        self._verify_positions = VERIFY_POSITIONS[strategy.device]
        self._layouts = RowLayouts()
        self.spec_stats = SpecStats()
        # Set by the memory gate for the next step: verify no drafts (plain decode).
        self.hold_drafts = False
        # The rows and draft limit of the last ``speculation_plan`` (what the gate
        # saw), for the next step only; None: no plan (a runner driven by hand).
        self._planned: tuple[frozenset[str], int] | None = None
        # A draft model proposes instead of prompt lookup (None: prompt lookup).
        self.draft: DraftProposer | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_steps(self) -> int:
        """Forwards run so far (plain and speculative)."""
        return self._num_steps

    def index(self, request_id: str) -> int | None:
        for i, row in enumerate(self.rows):
            if row.request_id == request_id:
                return i
        return None

    def join(self, rows: list[Row], feed: list[int], cache: list[BatchCacheLayer]) -> None:
        """Add rows whose ``cache`` (batched, in row order) holds everything
        before ``feed`` (one token per row, fed by the next step; it is never
        handed out by this batch)."""
        if not rows:
            return
        if not self.rows:
            self._cache = cache
            self._feed = mx.array(feed)
        else:
            for mine, theirs in zip(self._cache, cache, strict=True):
                mine.extend(theirs)
            assert self._feed is not None
            self._feed = mx.concatenate([self._feed, mx.array(feed, dtype=self._feed.dtype)])
        self.rows.extend(rows)
        self._fresh.extend([False] * len(rows))
        self._layouts.join(len(rows))
        self._joined = True

    def step(self) -> list[TokenOutput]:
        """One forward of every row; the tokens handed out."""
        planned, self._planned = self._planned, None
        held, self.hold_drafts = self.hold_drafts, False
        if not self.rows:
            return []
        if self.draft_limit() and self._trimmable():
            # Drafts need every token so far: pipelining stops while speculating.
            out = self._outputs_fresh()
            drafts = None if held or not self._as_planned(planned) else self._propose()
            if drafts is not None:
                return out + self._speculate(drafts)
            return out + self._decode()
        return self._decode()

    def _decode(self) -> list[TokenOutput]:
        """One token per row (the compiled step when proven)."""
        feed = self._feed
        assert feed is not None
        logits = None
        if self._compiled is not None:
            # Never prove on a step that hands out first tokens.
            logits = self._compiled(feed, self._cache, prove=not self._joined)
        self._joined = False
        if logits is None:
            logits = self._model(feed[:, None], cache=self._cache)[:, -1, :]
        logits = self._process(logits, feed)
        sampled = self._sample(logits)
        asked = asked_logprobs(self.rows, logits, sampled)
        lazy = [sampled, *(asked.pending.arrays() if asked is not None else [])]
        if self._pipelined:
            mx.async_eval(lazy)
            # The tokens sampled last step (in ``feed``) leave now, with their logprobs.
            out = self._outputs(int_list(feed), self._feed_logprobs, self._fresh)
            self._fresh = [True] * len(self.rows)
        else:
            mx.eval(lazy)
            out = self._outputs(int_list(sampled), asked, [True] * len(self.rows))
        self._feed, self._feed_logprobs = sampled, asked
        self._num_steps += 1
        if self._num_steps % _CLEAR_EVERY == 0:
            mx.clear_cache()
        return out

    def _outputs(
        self, tokens: list[int], asked: AskedLogprobs | None, send: list[bool]
    ) -> list[TokenOutput]:
        logprobs: dict[str, TokenLogprob] = {}
        if asked is not None:
            logprobs = asked.resolve(
                {r.request_id: t for r, t in zip(self.rows, tokens, strict=True)}
            )
        for row, t, fresh in zip(self.rows, tokens, send, strict=True):
            if fresh and row.drafter is not None:
                row.drafter.append(t)
        return [
            TokenOutput(row.request_id, t, logprobs.get(row.request_id))
            for row, t, fresh in zip(self.rows, tokens, send, strict=True)
            if fresh
        ]

    def _trimmable(self) -> bool:
        """Whether a speculative step can cut rejected positions off the cache:
        plain KV layers only (a recurrent state or a rolling window cannot)."""
        return all(type(layer) is BatchKVCache for layer in self._cache)

    def _outputs_fresh(self) -> list[TokenOutput]:
        """The sampled tokens in ``_feed`` not handed out yet (pipelined steps)."""
        if not any(self._fresh) or self._feed is None:
            return []
        out = self._outputs(int_list(self._feed), self._feed_logprobs, self._fresh)
        self._fresh, self._feed_logprobs = [False] * len(self.rows), None
        return out

    def speculation_plan(self) -> list[tuple[str, int, int]]:
        """(request id, positions, context tokens) per row the next step may
        verify more than one position of (for the memory gate; an upper bound:
        whether a row drafts is known only in the step). The next step drafts
        only as planned here (``_as_planned``)."""
        limit = self.draft_limit() if self._trimmable() else 0
        self._planned = (frozenset(row.request_id for row in self.rows), limit)
        if not self.rows or not limit:
            return []
        context = columns(self._cache[0]) if self._cache else 0
        width = verify_width(limit + 1)
        # A draft model's forwards of a row (its catch-up, its drafts) count with the
        # row's verified positions, under the row's id: the scheduler gates its rows.
        drafting = self.draft.planned_positions(self.rows, limit) if self.draft else []
        extra = {rid: n for rid, n, _ in drafting}
        return [
            (row.request_id, width + extra.get(row.request_id, 0), context)
            for row in self.rows
            if row.drafter is not None
        ]

    def _as_planned(self, planned: tuple[frozenset[str], int] | None) -> bool:
        """Whether this step may draft as the gate saw it: no row joined since the
        plan (a joining row's draft catch-up and verified positions were not in it)
        and no more drafts per row than planned (rows that left raise the limit).
        A step without a plan (a runner driven by hand) drafts freely."""
        if planned is None:
            return True
        rows, limit = planned
        if all(row.request_id in rows for row in self.rows) and self.draft_limit() <= limit:
            return True
        self.spec_stats.unplanned_steps += 1
        return False

    def draft_limit(self) -> int:
        """Tokens each row may draft this step: ``num_draft``, cut so that the
        rows' verified positions stay within the backend's budget (0: none)."""
        per_row = self._verify_positions // max(len(self.rows), 1)
        limit = min(self.num_draft, per_row - 1)
        while limit > 0 and verify_width(limit + 1) > per_row:
            limit -= 1
        return max(limit, 0)

    def _propose(self) -> list[list[int]] | None:
        """Each row's drafts (at most ``draft_limit()``), or None when no row drafts."""
        limit = self.draft_limit()
        if not limit:
            return None
        if self.draft is not None:
            budgets = [limit if row.drafter is not None else 0 for row in self.rows]
            proposed = self.draft.propose(self.rows, budgets)
            for e, row in enumerate(self.rows):
                row.draft_logits = proposed.logits[e]
            drafts = proposed.tokens
        else:
            drafts = [
                row.drafter.propose(limit) if row.drafter is not None else [] for row in self.rows
            ]
        return drafts if any(drafts) else None

    def _speculate(self, drafts: list[list[int]]) -> list[TokenOutput]:
        """One forward of every row's token and drafts (rows padded to the
        widest); the drafts the model agrees with and one token after them leave.
        Each row's cache keeps exactly what it accepted (row_layout.py)."""
        assert self._feed is not None
        seqs = [[token, *draft] for token, draft in zip(int_list(self._feed), drafts, strict=True)]
        width = verify_width(max(len(seq) for seq in seqs))
        padded = [seq + [seq[-1]] * (width - len(seq)) for seq in seqs]
        fed = mx.array(padded)
        logits = self._compiled.verify(fed, self._cache) if self._compiled is not None else None
        if logits is None:
            logits = self._model(fed, cache=self._cache)
        verdicts = verify_rows(self.rows, logits, seqs)
        if self.draft is not None:
            self._draft_verified(verdicts)
        valid = [1 + v.num_accepted for v in verdicts]
        if width > max(valid):
            for layer in self._cache:
                layer.trim(width - max(valid))
        self._layouts.settle(self._cache, valid)
        out = []
        for row, seq, n, v in zip(self.rows, seqs, valid, verdicts, strict=True):
            if row.processors:
                row.remember(mx.array(seq[:n]))
            tokens = [*seq[1:n], v.token]
            if row.drafter is not None:
                row.drafter.extend(tokens)
            out += [TokenOutput(row.request_id, t) for t in tokens[:-1]]
            out.append(TokenOutput(row.request_id, v.token, v.logprobs))
        self._feed = mx.array([v.token for v in verdicts])
        self.spec_stats.add(drafts, verdicts)
        self._num_steps += 1
        return out

    def _draft_verified(self, verdicts: list[Any]) -> None:
        """The draft model's cache cut back to what the rows kept; its logits dropped."""
        assert self.draft is not None
        kept = {}
        for row, verdict in zip(self.rows, verdicts, strict=True):
            row.draft_logits = None
            kept[row.request_id] = verdict.num_accepted
        self.draft.commit(kept)

    def _process(self, logits: mx.array, feed: mx.array) -> mx.array:
        """Each row's logits processors (repetition penalty, grammar) on its row."""
        if not any(row.processors for row in self.rows):
            return logits
        processed = []
        for e, row in enumerate(self.rows):
            one = logits[e : e + 1]
            if row.processors:
                context = row.remember(feed[e : e + 1])
                for processor in row.processors:
                    one = processor(context, one)
            processed.append(one)
        return mx.concatenate(processed, axis=0)

    def _sample(self, logits: mx.array) -> mx.array:
        first = self.rows[0].sampler
        if all(row.sampler is first for row in self.rows):
            return first(logits)  # one call for the batch (greedy rows share a sampler)
        return mx.concatenate(
            [row.sampler(logits[e : e + 1]) for e, row in enumerate(self.rows)], axis=0
        )

    def extract(self, request_id: str) -> list[CacheLayer] | None:
        """A row's cache as a plain prompt cache (a copy)."""
        i = self.index(request_id)
        return None if i is None else self._row_cache(i)

    def _row_cache(self, i: int) -> list[CacheLayer]:
        return self._layouts.in_order(i, [layer.extract(i) for layer in self._cache])

    def remove(self, request_ids: set[str], *, extract: bool) -> dict[str, list[CacheLayer]]:
        """Take rows out (their unsent sampled tokens are dropped); with
        ``extract``, returns each one's cache."""
        gone = [i for i, row in enumerate(self.rows) if row.request_id in request_ids]
        if not gone:
            return {}
        if self.draft is not None:
            self.draft.drop({self.rows[i].request_id for i in gone})
        out = {}
        if extract:
            out = {self.rows[i].request_id: self._row_cache(i) for i in gone}
        keep = _others(len(self.rows), gone)
        if not keep:
            self.rows, self._cache, self._feed, self._fresh = [], [], None, []
            self._feed_logprobs = None
            self._layouts.clear()
            return out
        for layer in self._cache:
            layer.filter(keep)
        assert self._feed is not None
        self._feed = self._feed[mx.array(keep)]
        self.rows = [self.rows[i] for i in keep]
        self._fresh = [self._fresh[i] for i in keep]
        self._layouts.keep(keep)
        return out
