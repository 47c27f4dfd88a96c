"""Scheduler behaviour: batching/chunking invariance, prefix reuse, retraction, cache accounting and
flush, stop conditions and n>1."""

from __future__ import annotations

import pytest

import tide
from conftest import random_prompts
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req

MAX_NEW = 32
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LENGTHS = [3, 7, 12, 18, 25, 33, 41, 50, 60]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(7, LENGTHS)


@pytest.fixture(scope="module")
def reference(llama_path, prompts):
    """Greedy outputs of a plain batched engine without prefix caching."""
    engine = tide.Engine(str(llama_path), disable_radix_cache=True)
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def _assert_clean(engine) -> None:
    """Idle engine: accounting holds with cached KV; after flush every slot is free."""
    sched = engine.scheduler
    assert not sched.has_work()
    sched.check_invariants()
    assert sched.tree_cache.protected_size() == 0, "idle engine still has locked radix nodes"
    assert engine.flush_cache() is True
    sched.check_invariants()
    assert sched.allocator.available_size() == sched.max_total_tokens
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert sched.tree_cache.total_size() == 0
    assert sched.tree_cache.evictable_size() == 0


def _run_stepwise(engine, reqs: list[Req], max_steps: int = 10_000) -> None:
    """Drive the scheduler by hand, checking the KV/slot invariants after every step."""
    sched = engine.scheduler
    for req in reqs:
        sched.add_request(req)
    for _ in range(max_steps):
        if not sched.has_work():
            break
        sched.step()
        sched.check_invariants()
    else:  # pragma: no cover - a livelock is a failure
        pytest.fail(f"scheduler made no progress in {max_steps} steps")
    assert all(r.finished for r in reqs)


def _greedy_reqs(prompts, max_new=MAX_NEW, tag="r"):
    sp = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    return [Req(rid=f"{tag}{i}", origin_input_ids=list(p), sampling_params=sp) for i, p in enumerate(prompts)]


# ---- (a) one at a time == batched == chunked


def test_one_at_a_time_equals_batched(llama_path, prompts, reference):
    engine = tide.Engine(str(llama_path))
    single = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert single == reference
    batched = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert batched == reference
    _assert_clean(engine)


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["radix", "noradix"])
def test_chunked_prefill_equals_batched(llama_path, prompts, reference, disable_radix_cache):
    engine = tide.Engine(
        str(llama_path),
        chunked_prefill_size=8,
        max_prefill_tokens=8,
        disable_radix_cache=disable_radix_cache,
    )
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert [o["output_ids"] for o in outs] == reference
    stats = engine.scheduler.stats
    # Every extend forward computes at most 8 prompt tokens, so prompts were really split.
    assert stats.num_prefill_tokens == sum(len(p) for p in prompts)
    assert stats.num_forward_extend >= -(-sum(len(p) for p in prompts) // 8)
    _assert_clean(engine)


def test_chunked_prefill_stepwise_invariants(llama_path, prompts, reference):
    engine = tide.Engine(str(llama_path), chunked_prefill_size=8, max_prefill_tokens=8)
    reqs = _greedy_reqs(prompts)
    _run_stepwise(engine, reqs)
    assert [r.output_ids for r in reqs] == reference
    _assert_clean(engine)


# ---- (b) shared prefix


@pytest.fixture(scope="module")
def prefix_prompts():
    import random

    rng = random.Random(11)
    prefix = [rng.randrange(2, 512) for _ in range(48)]
    firsts = rng.sample(range(2, 512), 6)  # distinct first tail tokens: tails diverge at once
    return [prefix + [f] + [rng.randrange(2, 512) for _ in range(n)] for f, n in zip(firsts, [2, 4, 6, 8, 10, 12])]


@pytest.fixture(scope="module")
def prefix_reference(llama_path, prefix_prompts):
    engine = tide.Engine(str(llama_path), disable_radix_cache=True)
    outs = engine.generate(input_ids=prefix_prompts, sampling_params=GREEDY)
    for o in outs:
        assert o["meta_info"]["cached_tokens"] == 0
    assert engine.scheduler.stats.num_cached_tokens == 0
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked8"])
def test_shared_prefix_reuses_kv(llama_path, prefix_prompts, prefix_reference, chunked):
    opts = {"chunked_prefill_size": 8, "max_prefill_tokens": 8} if chunked else {}
    engine = tide.Engine(str(llama_path), **opts)
    stats = engine.scheduler.stats
    first = engine.generate(input_ids=prefix_prompts[0], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert stats.num_prefill_tokens == len(prefix_prompts[0])
    assert first["output_ids"] == prefix_reference[0]

    before = stats.num_prefill_tokens
    second = engine.generate(input_ids=prefix_prompts[1], sampling_params=GREEDY)
    computed = stats.num_prefill_tokens - before
    assert second["meta_info"]["cached_tokens"] >= 48
    assert computed == len(prefix_prompts[1]) - second["meta_info"]["cached_tokens"]
    assert computed < len(prefix_prompts[1]) - 40
    assert second["output_ids"] == prefix_reference[1]

    # The rest together: each reuses the shared prefix from the cache.
    before = stats.num_prefill_tokens
    rest = engine.generate(input_ids=prefix_prompts[2:], sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens"] >= 48 for o in rest)
    assert stats.num_prefill_tokens - before == sum(
        len(p) - o["meta_info"]["cached_tokens"] for p, o in zip(prefix_prompts[2:], rest)
    )
    assert [o["output_ids"] for o in rest] == prefix_reference[2:]

    # An exact repeat reuses everything but the last prompt token (always recomputed for logits).
    before = stats.num_prefill_tokens
    again = engine.generate(input_ids=prefix_prompts[3], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(prefix_prompts[3]) - 1
    assert stats.num_prefill_tokens - before == 1
    assert again["output_ids"] == prefix_reference[3]
    _assert_clean(engine)


def test_n_samples_of_one_prompt_prefill_it_once(llama_path, prefix_prompts, prefix_reference):
    """GRPO's n samples per prompt, all submitted at once: the first copy of each prompt is
    prefilled, the others wait one step and read it from the cache (a completed prompt is published
    at once, not when its request finishes); the tokens equal an engine without a prefix cache."""
    engine = tide.Engine(str(llama_path))
    stats = engine.scheduler.stats
    a, b = prefix_prompts[4], random_prompts(12, [40])[0]
    n = 5
    outs = engine.generate(input_ids=[a] * n + [b] * n, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs[:n]] == [prefix_reference[4]] * n
    ref_b = tide.Engine(str(llama_path), disable_radix_cache=True).generate(
        input_ids=b, sampling_params=GREEDY)["output_ids"]
    assert [o["output_ids"] for o in outs[n:]] == [ref_b] * n
    # Each prompt computed once, plus the last token of every other copy (recomputed for logits).
    assert stats.num_prefill_tokens == len(a) + len(b) + 2 * (n - 1)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == (
        [0] + [len(a) - 1] * (n - 1) + [0] + [len(b) - 1] * (n - 1))
    assert stats.num_prefix_deferrals >= 2 * (n - 1)
    _assert_clean(engine)


def test_a_prompt_is_reused_while_its_first_request_still_decodes(llama_path, prefix_prompts,
                                                                  prefix_reference):
    """A request admitted while another with the same prefix is still decoding reuses that
    prefix (published after its prefill), and both finish with the reference tokens."""
    engine = tide.Engine(str(llama_path))
    sched = engine.scheduler
    first = Req(rid="first", origin_input_ids=prefix_prompts[0],
                sampling_params=SamplingParams(**GREEDY))
    sched.add_request(first)
    while len(first.output_ids) < 3:
        sched.step()
    second = Req(rid="second", origin_input_ids=prefix_prompts[1],
                 sampling_params=SamplingParams(**GREEDY))
    sched.add_request(second)
    while sched.has_work():
        sched.step()
        sched.check_invariants()
    assert first.finished_reason is not None and second.cached_tokens >= 48
    assert first.output_ids == prefix_reference[0] and second.output_ids == prefix_reference[1]
    _assert_clean(engine)


def test_prefix_of_previous_output_is_reused(llama_path, prefix_prompts, prefix_reference):
    """A follow-up turn (prompt + previous completion + new tokens) hits prompt *and* output KV."""
    engine = tide.Engine(str(llama_path))
    first = engine.generate(input_ids=prefix_prompts[0], sampling_params=GREEDY)
    follow = prefix_prompts[0] + first["output_ids"] + [7, 8, 9]
    out = engine.generate(input_ids=follow, sampling_params=dict(GREEDY, max_new_tokens=8))
    # Finished requests cache prompt + all outputs but the last (its KV was never computed).
    assert out["meta_info"]["cached_tokens"] == len(prefix_prompts[0]) + MAX_NEW - 1
    ref = tide.Engine(str(llama_path), disable_radix_cache=True).generate(
        input_ids=follow, sampling_params=dict(GREEDY, max_new_tokens=8)
    )
    assert out["output_ids"] == ref["output_ids"]
    _assert_clean(engine)


# ---- (c) retraction


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["radix", "noradix"])
@pytest.mark.parametrize("max_total_tokens", [100, 160])
def test_retraction_keeps_outputs(llama_path, max_total_tokens, disable_radix_cache):
    prompts = random_prompts(21, [6, 9, 12, 15, 18, 21, 24, 27])
    assert max(len(p) for p in prompts) + MAX_NEW < max_total_tokens  # each fits alone...
    assert sum(len(p) + MAX_NEW for p in prompts) > 2 * max_total_tokens  # ...but not together
    big = tide.Engine(str(llama_path), disable_radix_cache=True)
    ref = [o["output_ids"] for o in big.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert big.scheduler.stats.num_retractions == 0

    engine = tide.Engine(
        str(llama_path), max_total_tokens=max_total_tokens, disable_radix_cache=disable_radix_cache
    )
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert engine.scheduler.stats.num_retractions > 0
    assert [o["output_ids"] for o in outs] == ref
    for o in outs:
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert len(o["meta_info"]["output_token_logprobs"]) == MAX_NEW
    _assert_clean(engine)


def test_retraction_stepwise_invariants(llama_path):
    prompts = random_prompts(22, [10, 14, 18, 22, 26, 30])
    ref = [
        o["output_ids"]
        for o in tide.Engine(str(llama_path), disable_radix_cache=True).generate(
            input_ids=prompts, sampling_params=GREEDY
        )
    ]
    engine = tide.Engine(str(llama_path), max_total_tokens=90, chunked_prefill_size=8)
    reqs = _greedy_reqs(prompts)
    _run_stepwise(engine, reqs)
    assert engine.scheduler.stats.num_retractions > 0
    assert sum(r.num_retractions for r in reqs) == engine.scheduler.stats.num_retractions
    assert [r.output_ids for r in reqs] == ref
    _assert_clean(engine)


# ---- (d)/(e) flush and accounting


def test_flush_after_finish_frees_everything(llama_path, prompts):
    engine = tide.Engine(str(llama_path), max_total_tokens=2048)
    engine.generate(input_ids=prompts, sampling_params=GREEDY)
    sched = engine.scheduler
    # Before flushing: the finished requests' KV sits in the radix cache, all of it evictable.
    sched.check_invariants()
    assert sched.tree_cache.total_size() > 0
    assert sched.tree_cache.protected_size() == 0
    assert sched.allocator.available_size() + sched.tree_cache.total_size() == 2048
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    _assert_clean(engine)
    # The engine still works after a flush, with a cold cache.
    out = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0


def test_flush_refused_while_work_is_queued_or_running(llama_path):
    engine = tide.Engine(str(llama_path))
    sched = engine.scheduler
    req = Req(
        rid="queued",
        origin_input_ids=[3, 4, 5, 6, 7],
        sampling_params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
    )
    sched.add_request(req)
    assert sched.num_queued() == 1
    assert engine.flush_cache() is False
    assert sched.num_queued() == 1, "a refused flush must not drop queued work"
    sched.step()  # prefill: now running
    assert sched.num_running() == 1 and not req.finished
    assert engine.flush_cache() is False
    sched.check_invariants()
    while sched.has_work():
        sched.step()
        sched.check_invariants()
    assert req.finished_reason == {"type": "length", "length": 6}
    assert len(req.output_ids) == 6
    ref = engine.generate(input_ids=[3, 4, 5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=6))
    assert req.output_ids == ref["output_ids"]
    _assert_clean(engine)


def test_shutdown_aborts_and_frees(llama_path):
    engine = tide.Engine(str(llama_path))
    sched = engine.scheduler
    reqs = _greedy_reqs(random_prompts(5, [8, 12, 16]), tag="abort")
    for r in reqs:
        sched.add_request(r)
    sched.step()
    sched.step()
    engine.shutdown()
    assert all(r.finished_reason["type"] == "abort" for r in reqs)
    _assert_clean(engine)


# ---- (f) stop conditions, max_new_tokens, n > 1


STOP_PROMPTS = ["Python is", "lazy dog", "The quick brown fox", "In the beginning", "work quickly"]


def _pick_stop_string(tokenizer, ids: list[int]) -> tuple[str, int] | None:
    """A stop string from the middle of the output and the index of the token that completes it."""
    for pos in range(4, len(ids) - 2):
        piece = tokenizer.decode([ids[pos]], skip_special_tokens=True).strip()
        if len(piece) < 2 or not piece.isascii() or not piece.isprintable():
            continue
        # First output position whose decoded prefix contains the stop.
        k = next(
            k
            for k in range(len(ids))
            if piece in tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        )
        if k >= 2:
            return piece, k
    return None


@pytest.fixture(scope="module")
def free_run(llama_engine):
    """A greedy continuation of a text prompt with a stop string the model will really produce
    (the random model often emits ids outside the small tokenizer, which decode to "")."""
    for prompt in STOP_PROMPTS:
        out = llama_engine.generate(prompt=prompt, sampling_params=GREEDY)
        assert len(out["output_ids"]) == MAX_NEW
        picked = _pick_stop_string(llama_engine.tokenizer, out["output_ids"])
        if picked is not None:
            out["prompt"] = prompt
            out["stop"], out["stop_index"] = picked
            return out
    pytest.fail("none of the prompts produced a usable stop string")


def test_max_new_tokens_length_reason(llama_engine):
    for n in (1, 5):
        out = llama_engine.generate(input_ids=[9, 10, 11], sampling_params=dict(GREEDY, max_new_tokens=n))
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert len(out["output_ids"]) == n == out["meta_info"]["completion_tokens"]


def test_max_new_tokens_zero(llama_engine):
    out = llama_engine.generate(input_ids=[9, 10, 11], sampling_params=dict(GREEDY, max_new_tokens=0))
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # tagged with the weights it was served under, as every finished request (RL tags rollouts)
    assert out["meta_info"]["weight_version"] == llama_engine.handover.weight_version is not None
    assert not llama_engine.scheduler.has_work()


def test_stop_token_ids(llama_engine, free_run):
    ids = free_run["output_ids"]
    pos = 6
    stop_tok = ids[pos]
    first = ids.index(stop_tok)
    out = llama_engine.generate(
        prompt=free_run["prompt"],
        sampling_params=dict(GREEDY, stop_token_ids=[stop_tok]),
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["output_ids"] == ids[: first + 1]


def test_stop_string_truncates_text(llama_engine, free_run):
    tok = llama_engine.tokenizer
    ids = free_run["output_ids"]
    stop, k = free_run["stop"], free_run["stop_index"]
    out = llama_engine.generate(prompt=free_run["prompt"], sampling_params=dict(GREEDY, stop=stop))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[: k + 1]
    full_text = tok.decode(ids[: k + 1], skip_special_tokens=True)
    assert out["text"] == full_text[: full_text.index(stop)]
    assert stop not in out["text"]
    assert free_run["text"].startswith(out["text"])


def test_stop_list_first_hit_wins(llama_engine, free_run):
    stop, k = free_run["stop"], free_run["stop_index"]
    never = "\x00never-generated\x00"
    out = llama_engine.generate(
        prompt=free_run["prompt"], sampling_params=dict(GREEDY, stop=[never, stop])
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["output_ids"]) == k + 1


def test_unmatched_stop_runs_to_length(llama_engine, free_run):
    out = llama_engine.generate(
        prompt=free_run["prompt"], sampling_params=dict(GREEDY, stop="\x00never\x00", stop_token_ids=[])
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
    assert out["output_ids"] == free_run["output_ids"]
    assert out["text"] == free_run["text"]


def test_eos_stops_unless_ignored(llama_path, free_run, tmp_path):
    """Make the 4th greedy token the eos id (via generation_config.json) and check both modes."""
    import json
    import shutil

    eos = free_run["output_ids"][3]
    first = free_run["output_ids"].index(eos)
    path = tmp_path / "ckpt"
    shutil.copytree(llama_path, path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = [0, eos]
    gen_path.write_text(json.dumps(gen))
    engine = tide.Engine(str(path))
    assert eos in engine.eos_token_ids
    params = {"temperature": 0, "max_new_tokens": MAX_NEW}
    out = engine.generate(prompt=free_run["prompt"], sampling_params=params)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["output_ids"] == free_run["output_ids"][: first + 1]
    out = engine.generate(prompt=free_run["prompt"], sampling_params=dict(params, ignore_eos=True))
    assert out["output_ids"] == free_run["output_ids"]


def test_n_expands_into_n_outputs(llama_engine):
    out = llama_engine.generate(
        input_ids=[[5, 6, 7], [8, 9]],
        sampling_params={"n": 3, "temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        rid=["a", "b"],
    )
    assert isinstance(out, list) and len(out) == 6
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 3, 2, 2, 2]
    # Greedy copies are identical.
    assert out[0]["output_ids"] == out[1]["output_ids"] == out[2]["output_ids"]
    assert out[3]["output_ids"] == out[4]["output_ids"] == out[5]["output_ids"]

    single = llama_engine.generate(
        input_ids=[5, 6, 7], sampling_params={"n": 2, "temperature": 0, "max_new_tokens": 4}
    )
    assert isinstance(single, list) and len(single) == 2

    sampled = llama_engine.generate(
        input_ids=[5, 6, 7], sampling_params={"n": 4, "temperature": 1.0, "max_new_tokens": 16}
    )
    assert len({tuple(o["output_ids"]) for o in sampled}) > 1, "n>1 samples should differ"


def test_single_vs_list_return_shape(llama_engine):
    one = llama_engine.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=2))
    assert isinstance(one, dict)
    many = llama_engine.generate(input_ids=[[5, 6, 7]], sampling_params=dict(GREEDY, max_new_tokens=2))
    assert isinstance(many, list) and len(many) == 1
    assert many[0]["output_ids"] == one["output_ids"]


def test_max_running_requests_caps_the_batch(llama_path, prompts, reference):
    engine = tide.Engine(str(llama_path), max_running_requests=2)
    reqs = _greedy_reqs(prompts)
    sched = engine.scheduler
    for r in reqs:
        sched.add_request(r)
    while sched.has_work():
        sched.step()
        assert sched.num_running() <= 2
        sched.check_invariants()
    assert [r.output_ids for r in reqs] == reference
    assert sched.stats.num_forward_extend >= len(prompts) // 2
    _assert_clean(engine)


def test_abort_one_request_mid_run(llama_path, prompts, reference):
    engine = tide.Engine(str(llama_path))
    sched = engine.scheduler
    reqs = _greedy_reqs(prompts[:4])
    for r in reqs:
        sched.add_request(r)
    for _ in range(5):
        sched.step()
    aborted = sched.abort("r1", message="client went away")
    assert aborted == [reqs[1]]
    assert reqs[1].finished_reason == {"type": "abort", "message": "client went away"}
    sched.check_invariants()
    while sched.has_work():
        sched.step()
        sched.check_invariants()
    for i in (0, 2, 3):
        assert reqs[i].output_ids == reference[i]
    assert reference[1][: len(reqs[1].output_ids)] == reqs[1].output_ids
    _assert_clean(engine)


# ---- mixed workload under pressure: every feature at once, invariants after every step


STRESS_CONFIGS = [
    {"chunked_prefill_size": 8, "max_prefill_tokens": 16, "max_total_tokens": 80, "max_running_requests": 3},
    {"max_total_tokens": 80, "disable_radix_cache": True},
    {"chunked_prefill_size": 16, "max_total_tokens": 90},
]


@pytest.mark.parametrize("opts", STRESS_CONFIGS, ids=["chunk8-mrr3", "noradix", "chunk16"])
def test_mixed_workload_under_kv_pressure(llama_path, opts):
    import random

    rng = random.Random(5)
    shared = [rng.randrange(2, 512) for _ in range(24)]
    prompts = []
    for i in range(10):
        tail = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 20))]
        prompts.append(shared + tail if i % 2 else tail + shared[:5])
    params = []
    for i in range(10):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, seed=100 + i, max_new_tokens=20, ignore_eos=True))
        else:
            params.append(
                SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.2)
            )

    def make():
        return [
            Req(rid=f"s{i}", origin_input_ids=list(p), sampling_params=sp, return_logprob=True)
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]

    ref_engine = tide.Engine(str(llama_path), disable_radix_cache=True)
    ref = make()
    _run_stepwise(ref_engine, ref)
    engine = tide.Engine(str(llama_path), **opts)
    reqs = make()
    _run_stepwise(engine, reqs)
    assert engine.scheduler.stats.num_retractions > 0
    for r, q in zip(reqs, ref):
        assert r.output_ids == q.output_ids, r.rid
        assert len(r.output_token_logprobs) == len(r.output_ids)
        assert r.finished_reason == {"type": "length", "length": r.sampling_params.max_new_tokens}
    _assert_clean(engine)


# ---- stop strings with scripted tokens (exact control over what the "model" emits)


class _ScriptedSampler:
    """Stands in for the scheduler's sampler: request i emits `script[k]` as its k-th token."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def __call__(self, logits, info, greedy_ids=None):
        from tide.layers.sampler import SampleOutput

        assert not info.argmax_only, "these requests sample (temperature 1): rows carry their outputs"
        return SampleOutput([self.script[len(out)] for out in info.output_ids], None, None)


@pytest.fixture(scope="module")
def scripted_engine(llama_path):
    return tide.Engine(str(llama_path))


@pytest.mark.parametrize(
    "text,stop",
    [
        ("hello world foo bar baz", "foo"),
        ("hello world foo bar baz", "o wor"),  # spans token boundaries
        ("xy ab cd efgh ijkl mnop", "ab cd"),
        ("ab é€ cd efgh ijkl mnop", "é€"),  # multi-byte characters, 5 byte tokens
        ("ab 😀😀 cd efgh ijkl mnop", "😀😀"),  # 2 characters, 8 byte tokens
        ("ab 答案：42 cd efgh ijkl", "答案："),  # 3 characters, 9 byte tokens
    ],
    ids=["word", "cross-token", "two-words", "latin1-euro", "emoji-pair", "cjk"],
)
def test_scripted_stop_strings(scripted_engine, monkeypatch, text, stop):
    tok = scripted_engine.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    monkeypatch.setattr(scripted_engine.worker, "sampler", _ScriptedSampler(ids + [5] * 8))
    # The token that completes the first occurrence of the stop string.
    k = next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1]))
    out = scripted_engine.generate(
        input_ids=[3, 4], sampling_params={"max_new_tokens": len(ids) + 4, "stop": stop, "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, (
        f"stop {stop!r} ({len(tok.encode(stop))} tokens) was generated but not detected"
    )
    assert out["output_ids"] == ids[: k + 1]
    assert out["text"] == text[: text.index(stop)]
    scripted_engine.scheduler.check_invariants()
