"""When tokens leave the runner, step by step, on a real (tiny, random) mlx-lm model.

Time to first token is counted in forward passes here: a token that waits one more
step waits a whole decode step (~60-100 ms for SmolLM2 on the CPU backend).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from omlx.cache.hot import HotTier
from omlx.cache.kv_codec import layer_layout
from omlx.cache.prefix import PrefixCache
from omlx.engine.runner import BatchRunner
from omlx.engine.sampling import make_request_sampler
from omlx.engine.solo import last_logits, output_head
from omlx.engine.strategy import ExecutionStrategy
from omlx.engine.stream import RequestStream
from omlx.scheduler import Request, SamplingParams
from omlx.scheduler.openings import plan_openings
from omlx.scheduler.placement import Placement
from tests.fixtures.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def llama(tiny_models_dir: Path):
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    return model


def reference(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens for ``prompt``."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


def make_runner(model, step_size: int, pipelined: bool | None = None) -> BatchRunner:
    return BatchRunner(
        model,
        prefill_step_size=step_size,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(pipelined=bool(pipelined)),
    )


def request(rid: str, prompt: list[int], n: int = 8) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n))


def start_burst(
    runner: BatchRunner, step_size: int, requests: list[Request], prefix: PrefixCache | None = None
) -> dict[str, int]:
    """Start requests arriving together with the shared openings the scheduler
    plans for them (from what the prefix index holds), as a step's plan does."""
    cached = {r.request_id: prefix.match(r.prompt_ids) if prefix else 0 for r in requests}
    return runner.add(requests, plan_openings(requests, cached, step_size))


def run(runner: BatchRunner, steps: int) -> list[dict[str, list[int]]]:
    """The tokens each step handed out, per request."""
    out = []
    for _ in range(steps):
        got: dict[str, list[int]] = {}
        for t in runner.step():
            got.setdefault(t.request_id, []).append(t.token_id)
        out.append(got)
    return out


def tokens_of(steps: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Every token each request got over ``steps`` (``run``'s output), in order."""
    got: dict[str, list[int]] = {}
    for step in steps:
        for rid, tokens in step.items():
            got.setdefault(rid, []).extend(tokens)
    return got


@pytest.mark.parametrize("pipelined", [False, True])
def test_batched_requests_hand_out_every_token_once_in_order(llama, pipelined: bool) -> None:
    runner = make_runner(llama, 128, pipelined)  # one prefill step holds all three prompts
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 71)), "c": list(range(90, 100))}
    runner.add([request(rid, p) for rid, p in prompts.items()])
    steps = run(runner, 9)
    # The prompts' prefill and the decode forward of their last tokens run in one
    # step. Unpipelined (the CPU default) its first tokens leave at its end; pipelined
    # (the GPU default) they leave after the next forward is queued, as in mlx-lm.
    first = 1 if pipelined else 0
    assert all(s == {} for s in steps[:first]) and set(steps[first]) == set(prompts)
    assert all(len(s[rid]) == 1 for s in steps[first:] for rid in prompts)
    for rid, prompt in prompts.items():
        got = [tok for s in steps for tok in s.get(rid, [])]
        assert got == reference(llama, prompt, 9 - first)  # in order, none repeated or lost
    runner.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_prompts_that_end_in_different_steps_join_the_decode_batch_as_they_end(
    llama, pipelined: bool
) -> None:
    # A 16-token prefill step: "short" (10 tokens) is in after one step, "long" (50)
    # after four; "late" arrives while both run and a solo request is mid-decode.
    runner = make_runner(llama, 16, pipelined)
    prompts = {"solo": list(range(200, 230)), "short": list(range(3, 13))}
    prompts |= {"long": list(range(60, 110)), "late": list(range(300, 321))}
    runner.add([request("solo", prompts["solo"], 12)])
    steps = run(runner, 3)
    runner.add([request(rid, prompts[rid], 12) for rid in ("short", "long")])
    steps += run(runner, 2)
    runner.add([request("late", prompts["late"], 12)])
    steps += run(runner, 12)
    lag = 1 if pipelined else 0
    first_step = {rid: next(i for i, s in enumerate(steps) if rid in s) for rid in prompts}
    assert first_step["short"] == 3 + lag  # one 16-token chunk holds it (9 tokens + last)
    assert first_step["long"] == 3 + 3 + lag  # 49 tokens: four chunks, the last in step 6
    assert first_step["late"] == 5 + 1 + lag  # 20 tokens: two chunks
    for rid, prompt in prompts.items():
        got = [tok for s in steps for tok in s.get(rid, [])]
        assert got == reference(llama, prompt, len(got)) and len(got) >= 9
    runner.remove(list(prompts))
    assert not runner.has_work
    runner.close()


def test_a_request_removed_mid_decode_leaves_the_others_unchanged(llama) -> None:
    runner = make_runner(llama, 64)
    runner.add([request("a", list(range(3, 30))), request("b", list(range(40, 60)))])
    before = run(runner, 4)
    runner.remove(["a"])
    after = run(runner, 4)
    assert all(set(s) == {"b"} for s in after)
    got_b = [tok for s in before + after for tok in s.get("b", [])]
    assert got_b == reference(llama, list(range(40, 60)), len(got_b))
    runner.remove(["b"])
    assert not runner.has_work
    runner.close()


@pytest.mark.parametrize("length", [1, 2, 10, 32])
def test_a_short_prompt_gets_its_first_token_from_one_forward(llama, length: int) -> None:
    # A lone request whose prompt (or rest of prompt after a cache hit) is short runs
    # it through one forward that also samples: its first step hands out a token.
    runner = make_runner(llama, 512)
    prompt = list(range(7, 7 + length))
    runner.add([request("solo", prompt)])
    steps = run(runner, 5)
    assert [len(s.get("solo", [])) for s in steps] == [1] * 5
    assert [s["solo"][0] for s in steps] == reference(llama, prompt, 5)
    runner.close()


def test_a_long_prompt_samples_in_its_last_chunk(llama) -> None:
    # llama's head runs on the last position alone, so the last chunk (here 22 tokens
    # after two 64-token chunks) is one forward that samples.
    runner = make_runner(llama, 64)
    prompt = list(range(7, 7 + 150))
    runner.add([request("solo", prompt)])
    steps = run(runner, 7)
    assert steps[:2] == [{}, {}]
    assert [s["solo"][0] for s in steps[2:]] == reference(llama, prompt, 5)
    runner.close()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_logits_of_the_last_position_alone_equal_the_full_forward(
    tiny_models_dir: Path, name: str
) -> None:
    model, _ = load(str(tiny_models_dir / name))
    assert output_head(model) is not None
    tokens = mx.array(list(range(3, 60)))
    full = model(tokens[None], cache=make_prompt_cache(model))[:, -1, :]
    last = last_logits(model, tokens, make_prompt_cache(model))
    assert last.shape == full.shape
    assert mx.allclose(last, full, atol=1e-4).item()


def test_a_model_without_a_separable_head_keeps_short_one_passes_only(tmp_path: Path) -> None:
    # gemma3 scales and post-processes after its final norm: logits come from the full
    # forward, so only a short rest (<= 32 tokens) samples in its one forward.
    build_tiny_model(tmp_path / "g", "gemma3_text", seed=4)
    model, _ = load(str(tmp_path / "g"))
    assert output_head(model) is None
    for length, first_token_step in ((20, 0), (40, 1)):
        runner = make_runner(model, 512)
        prompt = list(range(7, 7 + length))
        runner.add([request("solo", prompt)])
        steps = run(runner, 4)
        assert all(not s for s in steps[:first_token_step])
        got = [s["solo"][0] for s in steps[first_token_step:]]
        assert got == reference(model, prompt, len(got))
        runner.close()


def test_filtered_samplers_work_on_raw_logits() -> None:
    # Both steps hand samplers raw logits (no log-softmax); top-p exponentiates,
    # so without its own normalisation large logits overflow and the nucleus is lost.
    logits = mx.random.normal((1, 500), key=mx.random.key(0))
    params = SamplingParams(temperature=0.7, top_p=0.5, min_p=0.02, top_k=40, seed=11)
    shifted = make_request_sampler(params)
    plain = make_request_sampler(params)
    draws = [plain(logits).item() for _ in range(40)]
    assert [shifted(logits + 1000.0).item() for _ in range(40)] == draws
    probs = mx.softmax(logits[0]).tolist()
    order = sorted(range(500), key=lambda i: -probs[i])
    nucleus, mass = set(), 0.0
    for i in order:
        nucleus.add(i)
        mass += probs[i]
        if mass >= 0.5:
            break
    assert set(draws) <= nucleus and len(set(draws)) > 1


def test_a_finished_requests_blocks_are_stored_without_waiting_for_the_next_request(
    make_pool,
) -> None:
    # The prefix-cache stores of a finished request run while the engine is idle,
    # not at the start of the next request's prefill (on its time to first token).
    pool = make_pool(cache={"enabled": True, "block_size": 16})

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        prefix = engine.prefix_cache
        stream = RequestStream("one", asyncio.get_running_loop())
        prompt = tuple(range(5, 45))
        engine.submit(Request("one", prompt, SamplingParams(0.0, max_tokens=30)), stream)
        while not (await stream.get()).finished:
            pass
        # Prompt + answer = 70 tokens: 4 full 16-token blocks once the answer is stored
        # (3 at the first token, from the prompt). Nothing else is sent meanwhile.
        for _ in range(200):
            if prefix.stats()["blocks_stored"] >= 4:
                break
            await asyncio.sleep(0.01)
        assert prefix.stats()["blocks_stored"] >= 4

    asyncio.run(main())


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_request_removed_mid_prefill_leaves_the_batch_consistent(llama, pipelined: bool) -> None:
    # "long" (60 tokens, 16 per step) is still prefilling next to "a" and "b" when it is
    # aborted; a request arriving afterwards prefills with "a" and "b" decoding.
    runner = make_runner(llama, 16, pipelined)
    prompts = {"a": list(range(3, 15)), "b": list(range(20, 30)), "long": list(range(40, 100))}
    runner.add([request(rid, p, 12) for rid, p in prompts.items()])
    steps = run(runner, 2)
    assert "long" not in steps[0] and "long" not in steps[1]
    runner.remove(["long"])
    runner.add([request("c", list(range(200, 240)), 12)])
    steps += run(runner, 8)
    assert all("long" not in s for s in steps)
    for rid, prompt in [("a", prompts["a"]), ("b", prompts["b"]), ("c", list(range(200, 240)))]:
        got = [tok for s in steps for tok in s.get(rid, [])]
        assert len(got) >= 5 and got == reference(llama, prompt, len(got))
    runner.remove(["a", "b", "c"])
    assert not runner.has_work
    runner.close()


def test_the_prefill_plan_reports_each_batched_prompts_next_chunk(llama) -> None:
    # What the memory gate reads before a step: the chunk each prompt will feed, the
    # prompt tokens not yet in the cache, and the whole prompt (what it attends over).
    from omlx.engine.runner import PrefillChunk

    runner = make_runner(llama, 16)
    runner.add([request("a", list(range(3, 13))), request("b", list(range(20, 70)))])
    assert runner.prefill_plan() == [PrefillChunk("a", 9, 10, 10), PrefillChunk("b", 16, 50, 50)]
    run(runner, 1)  # "a" is in (9 tokens + its last through the decode step)
    assert runner.prefill_plan() == [PrefillChunk("b", 16, 50, 34)]
    run(runner, 2)
    assert runner.prefill_plan() == [PrefillChunk("b", 1, 50, 2)]
    run(runner, 1)
    assert runner.prefill_plan() == []
    runner.close()


def test_requests_starting_together_prefill_their_common_opening_once(llama) -> None:
    """Three prompts opening with the same 24 tokens (a system prompt) start
    together: the opening is prefilled once, each request has only its own part
    left to prefill, and every request still gets mlx-lm's tokens for its
    prompt alone. A fourth prompt with another opening prefills all of its own."""

    opening = [(11 * i) % 180 + 4 for i in range(24)]
    prompts = {
        "a": opening + [(7 * i) % 150 + 3 for i in range(9)],
        "b": opening + [(5 * i) % 140 + 2 for i in range(17)],
        "c": opening + [(3 * i) % 130 + 9 for i in range(5)],
        "other": [(13 * i) % 170 + 5 for i in range(30)],
    }
    runner = make_runner(llama, 64)
    start_burst(runner, 64, [request(rid, p, 8) for rid, p in prompts.items()])
    left = {c.request_id: c.num_remaining for c in runner.prefill_plan()}
    assert left == {"a": 9, "b": 17, "c": 5, "other": 30}
    got = tokens_of(run(runner, 12))
    for rid, prompt in prompts.items():
        assert got[rid][:8] == reference(llama, prompt, 8), rid
    runner.close()


def test_a_shared_opening_is_at_most_one_prefill_chunk(llama) -> None:
    """Openings longer than a prefill chunk share one chunk's worth (the rest
    prefills per request, chunk by chunk, under the memory gate)."""
    opening = [(11 * i) % 180 + 4 for i in range(40)]
    prompts = {
        "a": opening + [(7 * i) % 150 + 3 for i in range(6)],
        "b": opening + [(5 * i) % 140 + 2 for i in range(8)],
    }
    runner = make_runner(llama, 16)
    start_burst(runner, 16, [request(rid, p, 6) for rid, p in prompts.items()])
    left = {c.request_id: c.num_remaining for c in runner.prefill_plan()}
    assert left == {"a": 46 - 16, "b": 48 - 16}
    got = tokens_of(run(runner, 12))
    for rid, prompt in prompts.items():
        assert got[rid][:6] == reference(llama, prompt, 6), rid
    runner.close()


def test_a_burst_shares_its_opening_past_what_the_prefix_cache_holds(llama) -> None:
    """A chat template's preamble is in the prefix cache; a burst of requests goes on
    with a common part nobody sent before (a client's fixed opening of each turn)
    and then each its own. The common part is prefilled once, from the cached
    preamble, and every request still gets mlx-lm's tokens for its prompt alone.
    A request whose own hit already covers the common part keeps its hit."""
    layout = tuple("kv" for _ in llama.layers)
    prefix = PrefixCache("tiny@0", layout, 16, HotTier(1 << 26, mode="hot-only"), None)
    runner = BatchRunner(
        llama, prefill_step_size=64, stream=mx.new_stream(mx.cpu), prefix_cache=prefix
    )
    preamble = [(11 * i) % 180 + 4 for i in range(20)]
    common = [(17 * i) % 160 + 6 for i in range(14)]
    warm = preamble + [(19 * i) % 150 + 7 for i in range(6)]
    runner.add([request("warm", warm, 2)])
    run(runner, 3)
    runner.remove(["warm"])
    run(runner, 1)  # the store runs at the start of the next step

    prompts = {
        "a": preamble + common + [(7 * i) % 150 + 3 for i in range(9)],
        "b": preamble + common + [(5 * i) % 140 + 2 for i in range(17)],
        "c": preamble + common + [(3 * i) % 130 + 9 for i in range(5)],
        # Its first 26 tokens are the warm prompt's: its hit covers the common 20.
        "again": warm + [(13 * i) % 170 + 5 for i in range(8)],
    }
    burst = [request(rid, p, 8) for rid, p in prompts.items()]
    hits = start_burst(runner, 64, burst, prefix)
    assert 0 < hits["a"] == hits["b"] == hits["c"] <= 20 < hits["again"]
    left = {c.request_id: c.num_remaining for c in runner.prefill_plan()}
    assert left == {"a": 9, "b": 17, "c": 5, "again": 34 - hits["again"]}
    got = tokens_of(run(runner, 12))
    for rid, prompt in prompts.items():
        assert got[rid][:8] == reference(llama, prompt, 8), rid
    runner.close()


def test_a_clear_right_after_a_request_ends_drops_its_blocks_too(llama) -> None:
    """A request's blocks are stored at the step after it ends (its response leaves
    first). A cache clear or memory release arriving in between must not find the
    cache empty and then see those blocks land: the clear stores them first and drops
    them with the rest, and a flush stores them at once."""
    layout = tuple("kv" for _ in llama.layers)
    hot = HotTier(1 << 26, mode="hot-only")
    prefix = PrefixCache("tiny@0", layout, 16, hot, None)
    runner = BatchRunner(
        llama, prefill_step_size=64, stream=mx.new_stream(mx.cpu), prefix_cache=prefix
    )
    prompt = [(11 * i) % 180 + 4 for i in range(40)]
    runner.add([request("done", prompt, 2)])
    run(runner, 3)
    runner.remove(["done"])
    runner.flush_cache_stores()
    assert hot.stats().hot_blocks > 0  # stored without another step
    runner.add([request("next", [*prompt[:30], 7, 8, 9, 10], 2)])
    run(runner, 3)
    runner.remove(["next"])
    runner.clear_prefix_cache("hot")
    run(runner, 2)  # nothing left to land after the clear
    assert hot.stats().hot_blocks == 0
    runner.close()


def test_a_lone_prompt_still_prefilling_moves_aside_when_others_arrive(tmp_path: Path) -> None:
    """A model whose caches need block-boundary snapshots (lfm2's convolution state):
    a lone request prefilling on its own moves to the side when two more arrive, keeps
    prefilling there a chunk per step, joins the batch at its last prompt token, and
    every request samples the tokens it samples alone (seeded: a random tiny model's
    greedy tokens hardly depend on the prompt)."""
    model, _ = load(str(build_tiny_model(tmp_path / "lfm2", "lfm2", seed=8)))
    layout = layer_layout(make_prompt_cache(model))
    assert layout is not None

    def snapshotting_runner() -> BatchRunner:
        prefix = PrefixCache("lfm2@0", layout, 16, HotTier(1 << 26, mode="hot-only"), None)
        assert prefix.needs_snapshots
        return BatchRunner(
            model,
            prefill_step_size=32,
            stream=mx.new_stream(mx.cpu),
            prefix_cache=prefix,
            strategy=ExecutionStrategy.fast_paths(pipelined=False),
        )

    def sampled(rid: str, prompt: list[int]) -> Request:
        return Request(rid, tuple(prompt), SamplingParams(temperature=1.0, seed=5, max_tokens=8))

    names = ["lone", "b", "c"]
    prompts = {
        rid: [(11 * k + 7 * i) % 180 + 4 for k in range(90 + 15 * i)] for i, rid in enumerate(names)
    }
    runner = snapshotting_runner()
    runner.add([sampled("lone", prompts["lone"])])
    steps = run(runner, 1)
    assert runner.layout().placed == {"lone": Placement.SOLO}
    runner.add([sampled(rid, prompts[rid]) for rid in ("b", "c")])
    assert runner.layout().placed == dict.fromkeys(prompts, Placement.SIDE)
    steps += run(runner, 20)  # 16-token chunks (block boundaries): c's prompt in 8
    assert runner.layout().placed == dict.fromkeys(prompts, Placement.BATCH)
    got = tokens_of(steps)
    runner.close()
    for rid, prompt in prompts.items():
        alone = snapshotting_runner()
        alone.add([sampled(rid, prompt)])
        assert got[rid][:8] == tokens_of(run(alone, 24))[rid][:8], rid
        alone.close()
