"""One sequence run without batching. MLX thread only.

A lone request prefills here on a plain prompt cache: its prompt's last chunk
samples the first token in the same forward, so the time to first token has no
separate decode step. It then decodes in the batch (batch.py) when the model has
a proven compiled batch step, which is faster even for one row (the plan moves
it: scheduler/placement.py). Otherwise it decodes here, pipelined like
mlx-lm's ``generate_step`` (the next token computes while the current one is
handed out), its steps compiled when the model qualifies (compiled.py), and
moves into the batch with its cache as soon as a second request arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx.cache.kv_codec import held_at
from omlx.engine.compiled import CompiledDecode
from omlx.engine.logprobs import PendingLogprobs, pending_logprobs
from omlx.engine.processor_context import processor_context
from omlx.mlx_types import CacheLayer, LanguageModel, int_list, item_int, prompt_cache
from omlx.models.vlm import TextModel
from omlx.scheduler import TokenLogprob

# Free MLX's buffer cache now and then, as generate_step does.
_CLEAR_EVERY = 256

# The last chunk of a prompt goes through one forward that also samples the first
# token, instead of a prefill chunk and then a forward of the last token alone: that
# second forward costs a whole decode step (benchmarks/README.md, "Figures behind
# design choices"). For models whose output head can run on the last position alone
# (_HEAD_AFTER_NORM) any last chunk qualifies; for others the one pass computes
# logits at every position, which outgrows the saved step past ~32 tokens.
_ONE_PASS_MAX = 32

# mlx-lm architectures whose logits are exactly the inner model's (normed) hidden
# states through the output head (their ``Model.__call__`` in mlx-lm 0.32.2).
_HEAD_AFTER_NORM = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})


def output_head(model: Any) -> Callable[[mx.array], mx.array] | None:
    """The model's output head when logits can be taken for chosen positions only.
    ``model``: any mlx-lm model (the head is read off llama/qwen's internals)."""
    if type(model).__module__ not in _HEAD_AFTER_NORM:
        return None
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear  # type: ignore[no-any-return]
    return model.lm_head  # type: ignore[no-any-return]


def last_logits(model: Any, tokens: mx.array, cache: list[CacheLayer]) -> mx.array:
    """Logits (1, vocab) after feeding 1-D ``tokens`` into ``cache``. ``model``: a
    LanguageModel, with an ``output_head`` reads its inner ``model`` too."""
    head = output_head(model) if tokens.size > 1 else None
    if head is None:
        logits: mx.array = model(tokens[None], cache=cache)[:, -1, :]
        return logits
    return head(model.model(tokens[None], cache)[:, -1, :])


@dataclass(frozen=True, slots=True)
class Handoff:
    """What the batch needs to continue a solo sequence."""

    cache: list[CacheLayer]
    # Tokens already in the cache (context for logits processors).
    cached_tokens: list[int]
    # Tokens still to feed: the rest of the prompt, or the one sampled token.
    feed: list[int]
    # A sampled token not yet handed out (None while still prefilling).
    unreported: int | None
    # Its logprobs, when the request asked.
    unreported_logprobs: TokenLogprob | None
    # The same sampler (a seeded one carries its PRNG key on) and processors.
    sampler: Callable[[mx.array], mx.array]
    processors: list[Any]


# Called after a prefill chunk that ends on a block boundary (or at the last
# prompt token before decoding): (tokens in the cache, the cache).
BoundaryHook = Callable[[int, list[CacheLayer]], None]


class SoloSequence:
    """``cache``/``num_cached``: a prompt cache already holding the first
    ``num_cached`` prompt tokens (a prefix-cache hit). With ``block_size`` and
    ``on_boundary``, prefill chunks end on every block boundary and the hook
    sees the cache there (for models whose state cannot be sliced later)."""

    def __init__(
        self,
        model: LanguageModel,
        request_id: str,
        prompt_ids: list[int],
        sampler: Callable[[mx.array], mx.array],
        processors: list[Any],
        prefill_step_size: int,
        *,
        cache: list[CacheLayer] | None = None,
        num_cached: int = 0,
        block_size: int = 0,
        on_boundary: BoundaryHook | None = None,
        decoder: CompiledDecode | None = None,
        logprobs: int | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
        prompt_inputs: dict[str, Any] | None = None,
        whole_prompt: bool = False,
        embedded_last: bool = False,
    ):
        self.request_id = request_id
        # Top alternatives wanted with each token's logprob (None: no logprobs).
        self.logprobs = logprobs
        # The logprobs of the token the last ``step`` returned.
        self.last_logprobs: TokenLogprob | None = None
        # Input embeddings (1, prompt tokens, hidden) fed instead of the prompt's ids
        # (a prompt with images); prefilled in chunks up to its last token, which
        # goes by id (the batch takes it from there).
        self._embeddings = embeddings
        # Their rope positions (3, 1, prompt tokens) for models whose image tokens
        # take 2-D positions (qwen2_vl); None: each token's index.
        self._positions = positions
        # Whole-prompt inputs the model slices by its cache offset itself, given
        # with each embeddings chunk (qwen3_vl's deepstack features).
        self._prompt_inputs = prompt_inputs or {}
        # The embedded prompt, its last token too, in one forward that samples the
        # first token, and no decode here (the batch takes it from that token): for
        # models whose prompt attends as one (paligemma's bidirectional attention).
        self._whole_prompt = whole_prompt and embeddings is not None
        # The last token apart with its embedding row, not by id (Family.last_token_apart).
        self._embedded_last = embedded_last
        self._model = model
        self._sampler = sampler
        self._processors = processors
        self._step_size = prefill_step_size
        self._cache = cache if cache is not None else prompt_cache(model)
        self._cached: list[int] = list(prompt_ids[:num_cached])
        self._prompt = list(prompt_ids[num_cached:])
        self._block_size = block_size
        self._on_boundary = on_boundary
        self._decoder = decoder
        self._y: mx.array | None = None  # sampled, computing, not handed out yet
        self._y_logprobs: PendingLogprobs | None = None
        # Everything fed so far, as a lazy array (only when processors need it).
        self._context = processor_context(self._cached) if processors else None
        self._num_steps = 0
        # The memory gate's cap on the next prefill chunk (None: none; 0: wait).
        self._cap: int | None = None
        self._one_pass_max = (
            prefill_step_size if output_head(model) else min(_ONE_PASS_MAX, prefill_step_size)
        )
        if isinstance(model, TextModel) and model.last_token_apart:
            self._one_pass_max = 1

    @property
    def cache(self) -> list[CacheLayer]:
        return self._cache

    @property
    def num_cached(self) -> int:
        """Tokens held by the cache (prompt, then output)."""
        return len(self._cached)

    def step(self) -> int | None:
        """One prefill chunk (returns None) or one decode step (returns a token;
        its logprobs, when asked, in ``last_logprobs``)."""
        if self._y is None and self._in_whole_pass():
            self._prefill_whole()
            return None
        if self._y is None and not self._in_one_pass():
            self._prefill_chunk()
            return None
        if self._y is None:
            # The rest of the prompt (at least its last token) samples the first
            # token, which goes out before the next forward is queued: queuing it
            # (async_eval) first put its cost on the CPU backend straight onto the
            # time to first token (benchmarks/README.md, "Figures behind design
            # choices"). The next step starts it.
            y, pending = self._forward(mx.array(self._prompt), embedded=self._whole_rest())
            self._cached.extend(self._prompt)
            self._prompt = []
            token = item_int(y)
            # Lazy, evaluated by the next step. Eager: the compiled step's first call
            # (its proof run, or a trace for a new buffer size) would hold the token.
            self._y, self._y_logprobs = self._forward(y, compiled=False)
        else:
            y, pending = self._y, self._y_logprobs
            self._y, self._y_logprobs = self._forward(y)
            mx.async_eval(self._y, *(self._y_logprobs.arrays() if self._y_logprobs else []))
            token = item_int(y)
        self.last_logprobs = self._resolve(pending, token)
        self._cached.append(token)
        self._num_steps += 1
        if self._num_steps % _CLEAR_EVERY == 0:
            mx.clear_cache()
        return token

    def _resolve(self, pending: PendingLogprobs | None, token: int) -> TokenLogprob | None:
        if pending is None:
            return None
        return pending.to_python([token], [self.logprobs or 0])[0]

    def settle(self) -> None:
        """Evaluate the decode forward queued at the end of the last step (its cache
        holds that forward's KV, lazily, until then)."""
        if self._y is not None:
            mx.eval(self._y, *(self._y_logprobs.arrays() if self._y_logprobs else []))

    def handoff(self) -> Handoff:
        """Stop here and describe the state the batch continues from."""
        rest = (self._sampler, self._processors)
        if self._y is None:
            return Handoff(self._cache, list(self._cached), list(self._prompt), None, None, *rest)
        token = item_int(self._y)
        logprobs = self._resolve(self._y_logprobs, token)
        # _cached already ends with the token that produced _y; _y is not cached.
        return Handoff(self._cache, list(self._cached), [token], token, logprobs, *rest)

    @property
    def decoding(self) -> bool:
        """Past the prompt: the first token went out, the next one is queued."""
        return self._y is not None

    @property
    def num_pending(self) -> int:
        """Prompt tokens not in the cache yet."""
        return len(self._prompt)

    def cap_next_chunk(self, cap: int | None) -> None:
        """The memory gate's cap on the next prefill chunk (0: it waits a step)."""
        self._cap = cap

    @property
    def held(self) -> bool:
        """Still prefilling, and told to wait this step."""
        return self._cap == 0 and self._y is None and len(self._prompt) > 1

    def _in_one_pass(self) -> bool:
        """Whether the next step feeds the whole rest of the prompt and samples.
        Not with a boundary hook: its snapshot is taken before the last token;
        nor past the gate's cap."""
        n = len(self._prompt)
        capped = self._cap is not None and n > self._cap
        chunked = self._on_boundary is not None or self._embeddings is not None
        return n <= 1 or (not chunked and n <= self._one_pass_max and not capped)

    @property
    def feeds_last_token(self) -> bool:
        """Its last prompt token still goes here, with its embedding row, sampling the
        first token before the batch takes over (Family.last_token_apart)."""
        return self._embedded_last and self._embeddings is not None and len(self._prompt) == 1

    @property
    def runs_whole(self) -> bool:
        """Its next step feeds the rest of its prompt in one forward, never in chunks:
        the memory gate runs it whole or holds it (throttle: an indivisible chunk)."""
        return self._y is None and self._whole_prompt and len(self._prompt) > 1

    def _in_whole_pass(self) -> bool:
        # A held one is not stepped (``held``): any other cap it runs past whole.
        return self.feeds_last_token or self.runs_whole

    def _prefill_whole(self) -> None:
        start = len(self._cached)
        embedded = self._whole_rest()
        self._y, self._y_logprobs = self._forward(mx.array(self._prompt), embedded=embedded)
        self._cached.extend(self._prompt)
        self._prompt = []
        if start == 0:
            self._whole_boundaries(len(self._cached) - 1)

    def _whole_boundaries(self, last: int) -> None:
        """The boundary hook at each block end of a prompt one forward filled from
        its first token, and before its last token, on the windows cut back there."""
        if self._on_boundary is None or not self._block_size:
            return
        ends = list(range(self._block_size, last + 1, self._block_size))
        for end in ends if ends and ends[-1] == last else [*ends, last]:
            layers = held_at(self._cache, end)
            if layers is None:
                return
            self._on_boundary(end, layers)

    def _whole_rest(self) -> mx.array | None:
        """A whole-prompt sequence's embedded rest of the prompt: its last token too
        goes with the prompt's inputs (mllama's cross-attention mask row)."""
        if not (self._whole_prompt or self._embedded_last) or self._embeddings is None:
            return None
        return self._embeddings[:, len(self._cached) :]

    def next_prefill_tokens(self) -> int:
        """Prompt tokens the next step will prefill (0 once decoding)."""
        if self._y is None and self._in_whole_pass():
            return len(self._prompt)
        if self._y is None and len(self._prompt) > 1 and self._in_one_pass():
            return len(self._prompt)
        n = min(self._step_size, len(self._prompt) - 1)
        if self._cap:
            n = min(n, self._cap)
        pos = len(self._cached)
        if n > 0 and self._on_boundary is not None and self._block_size:
            n = min(n, (pos // self._block_size + 1) * self._block_size - pos)
        return max(n, 0)

    def _prefill_chunk(self) -> None:
        n = self.next_prefill_tokens()
        pos = len(self._cached)
        chunk, self._prompt = self._prompt[:n], self._prompt[n:]
        if self._embeddings is None:
            self._model(mx.array(chunk)[None], cache=self._cache)
        else:
            embedded = self._embeddings[:, pos : pos + n]
            where = dict(self._prompt_inputs)
            if self._positions is not None:
                where["positions"] = self._positions[..., pos : pos + n]
            self._model(
                mx.array(chunk)[None], cache=self._cache, input_embeddings=embedded, **where
            )
        mx.eval([c.state for c in self._cache])
        self._cached.extend(chunk)
        if self._processors:
            self._remember(processor_context(chunk))
        end = pos + n
        if self._on_boundary is not None and (
            end % self._block_size == 0 or len(self._prompt) == 1
        ):
            self._on_boundary(end, self._cache)
        mx.clear_cache()

    def _remember(self, fed: mx.array | None) -> None:
        if self._processors and fed is not None:
            ctx = self._context
            self._context = fed if ctx is None else mx.concatenate([ctx, fed])

    def _forward(
        self, fed: mx.array, compiled: bool = True, embedded: mx.array | None = None
    ) -> tuple[mx.array, PendingLogprobs | None]:
        """Feed 1-D ``fed`` (or its ``embedded`` rows) and sample the next token
        (lazily), with its logprobs when the request asked."""
        logits = None
        decoder = self._decoder
        if embedded is not None:
            kwargs = {"input_embeddings": embedded, **self._prompt_inputs}
            logits = self._model(fed[None], cache=self._cache, **kwargs)[:, -1, :]
        elif compiled and decoder is not None and fed.size == 1 and decoder.accepts(self._cache):
            logits = decoder(fed, self._cache)
        if logits is None:
            logits = last_logits(self._model, fed, self._cache)
        if self._processors:
            # An embedded prompt's ids may hold image placeholders (processor_context).
            self._remember(fed if embedded is None else processor_context(int_list(fed)))
        for processor in self._processors:
            logits = processor(self._context, logits)
        y = self._sampler(logits)  # raw logits: see sampling.make_request_sampler
        if self.logprobs is None:
            return y, None
        return y, pending_logprobs(logits, y, self.logprobs)
