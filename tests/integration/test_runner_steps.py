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

from omlx.engine.runner import BatchRunner, make_request_sampler
from omlx.engine.stream import RequestStream
from omlx.scheduler import Request, SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_models_dir: Path):
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    return model


def reference(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens for ``prompt``."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


def make_runner(model, step_size: int) -> BatchRunner:
    return BatchRunner(
        model, max_batch_size=8, prefill_step_size=step_size, stream=mx.new_stream(mx.cpu)
    )


def request(rid: str, prompt: list[int], n: int = 8) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n))


def run(runner: BatchRunner, steps: int) -> list[dict[str, list[int]]]:
    """The tokens each step handed out, per request."""
    out = []
    for _ in range(steps):
        got: dict[str, list[int]] = {}
        for t in runner.step():
            got.setdefault(t.request_id, []).append(t.token_id)
        out.append(got)
    return out


def test_batched_requests_get_their_first_token_at_the_end_of_the_step_that_samples_it(
    llama,
) -> None:
    # On the CPU backend a batched step hands out the tokens it sampled, not the
    # previous step's (mlx-lm's pipelining): the first token leaves right after the
    # step that samples it, and no token is handed out twice.
    assert mx.default_device() == mx.cpu
    runner = make_runner(llama, 64)
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 71)), "c": list(range(90, 100))}
    runner.add([request(rid, p) for rid, p in prompts.items()])
    steps = run(runner, 8)
    assert steps[0] == {}  # the prompts' prefill
    assert set(steps[1]) == set(prompts)  # then every first token at once
    for rid, prompt in prompts.items():
        got = [tok for s in steps for tok in s.get(rid, [])]
        assert got == reference(llama, prompt, 7)  # in order, none repeated or lost
    runner.close()


def test_a_request_removed_after_an_early_token_leaves_nothing_behind(llama) -> None:
    runner = make_runner(llama, 64)
    runner.add([request("a", list(range(3, 30))), request("b", list(range(40, 60)))])
    run(runner, 3)
    runner.remove(["a"])
    later = run(runner, 4)
    assert all(set(s) == {"b"} for s in later)
    got_b = [tok for s in later for tok in s["b"]]
    assert got_b == reference(llama, list(range(40, 60)), 6)[2:]
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


def test_a_longer_prompt_prefills_first_and_gives_the_same_tokens(llama) -> None:
    runner = make_runner(llama, 512)
    prompt = list(range(7, 7 + 120))
    runner.add([request("solo", prompt)])
    steps = run(runner, 6)
    assert steps[0] == {}  # 119 tokens of prefill, then the last token samples
    assert [s["solo"][0] for s in steps[1:]] == reference(llama, prompt, 5)
    runner.close()


def test_filtered_samplers_work_on_raw_logits() -> None:
    # The decode step hands samplers raw logits (no log-softmax); top-p exponentiates,
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
