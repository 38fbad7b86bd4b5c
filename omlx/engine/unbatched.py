"""A model whose batched step fails serves one request at a time (issue 41, defect 1).

Some mlx-lm model files and cache types cannot batch: gpt_bigcode builds its
position ids from one offset, llama4's ChunkedKVCache "cannot be batched". Each
request alone works; several at once raise inside the forward, and every request
of the batch would get the error. A short probe at load (three rows of the runner's
batched prefill on fresh caches, which is where both fail) finds most such
models before any request; otherwise the first such failure (more than one
request running) turns the model to one request at a time for as long as it
stays loaded: the running requests go back to the head of the queue, oldest first, and
resume from what they already streamed (a preemption: the same tokens), so none
of them sees the error. A failure with one request running is that request's own
and ends it as before. The reason is in the log and in /health (``batching``).
"""

from __future__ import annotations

import logging

import mlx.core as mx

from omlx.engine.batch import PrefillBatch, Row
from omlx.mlx_types import LanguageModel, prompt_cache
from omlx.scheduler import Scheduler

log = logging.getLogger(__name__)

# Prompt tokens of each probe row (past the chunk: the batch's cache is built).
PROBE_TOKENS = 8
PROBE_ROWS = 3


def batch_probe(model: LanguageModel, vocab_size: int) -> str | None:
    """Run one step of the runner's batched prefill over three fresh rows (mlx-lm
    merges their caches into a batch cache; three, since gemma2's batched mask
    only fails to broadcast when the rows differ from its KV heads, often two).
    None when it runs; else why the model cannot batch."""
    batch = PrefillBatch(model, PROBE_TOKENS)
    try:
        for i in range(PROBE_ROWS):
            prompt = [(i * 31 + j * 7) % (vocab_size - 1) + 1 for j in range(PROBE_TOKENS + 1)]
            batch.add(Row(f"batch-probe-{i}", _greedy, []), prompt_cache(model), 0, prompt)
        _, cache = batch.step()
        mx.eval([c.state for c in cache])
    except Exception as exc:  # the model file's or cache type's own refusal
        return f"a batch of {PROBE_ROWS} failed at load ({type(exc).__name__}: {exc})"
    return None


def _greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def serve_one_at_a_time(
    scheduler: Scheduler, model: str, error: Exception
) -> tuple[str, list[str]]:
    """After a failed batched step: the scheduler runs one request at a time and the
    running ones are queued again. Returns the reason (for /health) and the requests
    that could not go back (a prompt with images that has output: they end)."""
    num_running = scheduler.num_running
    scheduler.max_running = 1
    stuck = scheduler.requeue_running()
    reason = f"a batch of {num_running} requests failed ({type(error).__name__}: {error})"
    log.warning(
        "model %s cannot batch: %s; serving its requests one at a time from now on "
        "(%d queued again to resume)",
        model,
        reason,
        num_running - len(stuck),
    )
    return reason, stuck
