"""Batched output against solo output, on the real model at load (issue 41, defect 2).

Some model files run a batch without error but mask or pad it wrongly: mlx-lm's
afm7 and longcat_flash_ngram give other tokens from the first step when requests
of different lengths share a step, as mlx-lm's own ``batch_generate`` does. At
load, a few greedy steps of three prompts of different lengths run together and
each alone, through a runner like the engine's (its placement: a lone request
solo, several batched); where the batch's logprobs or tokens differ from the
solo's beyond rounding, the model serves one request at a time (unbatched.py),
with the first row and step that differed as the reason. MLX thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from omlx.engine.runner import BatchRunner
from omlx.scheduler import Request, SamplingParams, TokenLogprob

# Prompt lengths (different: the batch pads them) and greedy steps compared.
PROMPT_LENGTHS = (9, 14, 6)
NUM_STEPS = 2
# How far a batched logprob may be from the solo's before it is a difference, by
# bytes per activation: rounding in a wider matmul moves float32 logprobs by ~1e-5;
# at 0.1, bf16 tiny models of every dense mlx-lm type showed no false difference
# (CPU). The masking bugs moved float32 tiny afm7's by 0.03-0.7.
TOLERANCE = {4: 0.02}
TOLERANCE_16_BIT = 0.1
# Alternatives kept per step: a differing token is looked up among the solo's.
_TOP = 4
# Steps before the probe gives up on a runner that hands out no tokens.
_MAX_STEPS = 64


def output_probe(
    new_runner: Callable[[], BatchRunner], vocab_size: int, activation_bytes: int
) -> str | None:
    """None when the batch gives each prompt its solo tokens (a flipped near tie
    counts as the same); else why not. ``new_runner``: a fresh runner like the
    engine's (no prefix cache, eager steps)."""
    prompts = [
        [(i * 53 + j * 11) % (vocab_size - 1) + 1 for j in range(n)]
        for i, n in enumerate(PROMPT_LENGTHS)
    ]
    tolerance = TOLERANCE.get(activation_bytes, TOLERANCE_16_BIT)
    try:
        batched = _greedy(new_runner(), prompts)
        solo = [_greedy(new_runner(), [prompt])[0] for prompt in prompts]
    except Exception as exc:  # rows of different lengths can fail where equal ones ran
        return f"a batch of {len(prompts)} failed at load ({type(exc).__name__}: {exc})"
    for row, alone in enumerate(solo):
        step = _first_difference(batched[row], alone, tolerance)
        if step is not None:
            return f"batched output differs from solo (row {row}, step {step})"
    return None


def _first_difference(
    mine: list[TokenLogprob], alone: list[TokenLogprob], tolerance: float
) -> int | None:
    for step, (got, want) in enumerate(zip(mine, alone, strict=True)):
        # The batch's token, ranked by the solo's distribution at this step.
        solo_logprob = dict(want.top).get(got.token_id, float("-inf"))
        if got.token_id == want.token_id:
            solo_logprob = want.logprob
        if abs(got.logprob - solo_logprob) > tolerance:
            return step
        if got.token_id != want.token_id:
            return None  # a near tie flipped: the inputs differ from here on
    return None


def _greedy(runner: BatchRunner, prompts: list[list[int]]) -> list[list[TokenLogprob]]:
    """Each prompt's first ``NUM_STEPS`` greedy tokens with their logprobs, all
    started together on ``runner`` (closed after: on a Mac it set the wired limit)."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, logprobs=_TOP)
    ids = [f"output-probe-{i}" for i in range(len(prompts))]
    got: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
    try:
        runner.add(Request(rid, tuple(p), params) for rid, p in zip(ids, prompts, strict=True))
        for _ in range(_MAX_STEPS):
            if all(len(steps) >= NUM_STEPS for steps in got.values()):
                break
            for token in runner.step():
                assert token.logprobs is not None  # every request asked
                got[token.request_id].append(token.logprobs)
        runner.remove(ids)
    finally:
        runner.close()
    if any(len(steps) < NUM_STEPS for steps in got.values()):
        raise RuntimeError(f"{_MAX_STEPS} steps gave fewer than {NUM_STEPS} tokens a row")
    return [got[rid][:NUM_STEPS] for rid in ids]
