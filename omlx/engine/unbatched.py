"""A model whose batched step fails serves one request at a time (issue 41, defect 1).

Some mlx-lm model files and cache types cannot batch: gpt_bigcode builds its
position ids from one offset, llama4's ChunkedKVCache "cannot be batched". Each
request alone works; several at once raise inside the forward, and every request
of the batch would get the error. The first such failure (more than one request
running) turns the model to one request at a time for as long as it stays
loaded: the running requests go back to the head of the queue, oldest first, and
resume from what they already streamed (a preemption: the same tokens), so none
of them sees the error. A failure with one request running is that request's own
and ends it as before. The reason is in the log and in /health (``batching``).
"""

from __future__ import annotations

import logging

from omlx.scheduler import Scheduler

log = logging.getLogger(__name__)


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
