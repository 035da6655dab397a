"""The workload generator: reproducible, realistic prefix sharing, Zipf popularity, held-out sets."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from kvevents.producer.simulator.cache import RetentionRange
from kvevents.producer.simulator.workload import (
    HELD_OUT_REQUEST_ID_BASE,
    Request,
    WorkloadConfig,
    WorkloadGenerator,
    answer_tokens,
    derive_seed,
    zipf_weights,
)


def stream(count: int, **kwargs) -> list[Request]:
    return WorkloadGenerator(WorkloadConfig(**kwargs)).take(count)


def test_same_config_gives_the_same_stream_and_another_seed_another_one() -> None:
    a, b = stream(300, seed=7), stream(300, seed=7)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    c = stream(300, seed=8)
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_content_is_shared_across_streams_with_the_same_content_seed() -> None:
    g1 = WorkloadGenerator(WorkloadConfig(seed=1, content_seed=5))
    g2 = WorkloadGenerator(WorkloadConfig(seed=2, content_seed=5))
    g3 = WorkloadGenerator(WorkloadConfig(seed=1, content_seed=6))
    assert g1.system_prompt(0) == g2.system_prompt(0) != g3.system_prompt(0)
    assert g1.document(3) == g2.document(3) != g3.document(3)
    with pytest.raises(IndexError):
        g1.document(10_000)


def test_first_turns_start_with_a_system_prompt_then_the_drawn_document() -> None:
    gen = WorkloadGenerator(WorkloadConfig(seed=3))
    seen_doc = False
    for r in gen.take(200):
        if r.turn:
            continue
        system = gen.system_prompt(r.system_prompt)
        assert r.prompt[: len(system)] == system
        if r.document is not None:
            seen_doc = True
            doc = gen.document(r.document)
            assert r.prompt[len(system) : len(system) + len(doc)] == doc
    assert seen_doc


def test_a_follow_up_turn_extends_the_previous_prompt_and_its_answer() -> None:
    cfg = WorkloadConfig(seed=4, follow_up_probability=0.8, follow_up_delay_s=0.0)
    requests = WorkloadGenerator(cfg).take(400)
    last: dict[int, Request] = {}
    follow_ups = 0
    for r in requests:
        prev = last.get(r.conversation_id)
        if r.turn:
            assert prev is not None and prev.turn == r.turn - 1
            history = prev.prompt + prev.output
            assert r.prompt[: len(history)] == history and len(r.prompt) > len(history)
            assert r.lora_id == prev.lora_id
            follow_ups += 1
        last[r.conversation_id] = r
        assert len(r.prompt) <= cfg.max_prompt_tokens
        assert r.turn < cfg.max_turns
    assert follow_ups > 100


def test_follow_ups_wait_for_the_delay() -> None:
    requests = stream(500, seed=5, follow_up_probability=1.0, follow_up_delay_s=3.0)
    previous: dict[int, float] = {}
    for r in requests:
        if r.turn:
            assert r.arrival_time - previous[r.conversation_id] >= 3.0
        previous[r.conversation_id] = r.arrival_time


def test_answers_are_a_deterministic_function_of_prompt_and_lora() -> None:
    r = stream(1, seed=6)[0]
    assert r.output == answer_tokens(r.prompt, r.lora_id, len(r.output), 32_000)
    long = answer_tokens(r.prompt, None, 300, 32_000)
    assert long[:50] == answer_tokens(r.prompt, None, 50, 32_000)
    assert answer_tokens(r.prompt, 1, 50, 32_000) != long[:50]
    other = r.prompt[:-1]
    assert answer_tokens(other, None, 50, 32_000) != long[:50]


def test_documents_follow_a_zipf_distribution() -> None:
    cfg = WorkloadConfig(
        seed=9, num_documents=50, zipf_exponent=1.2, document_probability=1.0, follow_up_probability=0.0
    )
    n = 6000
    counts = Counter(r.document for r in WorkloadGenerator(cfg).take(n))
    weights = zipf_weights(50, 1.2)
    total = sum(weights)
    for rank in (0, 1, 4, 20):
        p = weights[rank] / total
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[rank] / n - p) < 5 * sigma, (rank, counts[rank] / n, p)
    assert counts[0] > 3 * counts[9]  # the skew is plain to see
    assert counts.most_common(1)[0][0] == 0


def test_arrivals_are_poisson_at_the_configured_rate() -> None:
    requests = stream(4000, seed=10, request_rate=25.0)
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    mean_gap = times[-1] / len(times)
    assert abs(mean_gap - 1 / 25.0) < 0.05 / 25.0 * 3


def test_tokens_lengths_and_lora_stay_within_the_config() -> None:
    cfg = WorkloadConfig(
        seed=11, vocab_size=1000, lora_ids=(7, 9), lora_probability=1.0, output_tokens=(5, 9)
    )
    for r in WorkloadGenerator(cfg).take(300):
        assert min(r.prompt) >= 0 and max(r.prompt) < 1000
        assert 5 <= len(r.output) <= 9
        assert r.lora_id in (7, 9)


def test_retention_ranges_mark_the_system_prompt_and_the_conversation_history() -> None:
    cfg = WorkloadConfig(seed=12, follow_up_probability=0.9, follow_up_delay_s=0.0, document_priority=60)
    gen = WorkloadGenerator(cfg)
    by_conv: dict[int, Request] = {}
    checked_follow_up = False
    for r in gen.take(200):
        sys_len = len(gen.system_prompt(r.system_prompt))
        assert r.retention[0] == RetentionRange(0, sys_len, 80)
        if r.turn == 0 and r.document is not None:
            doc_len = len(gen.document(r.document))
            assert RetentionRange(sys_len, sys_len + doc_len, 60) in r.retention
        if r.turn:
            prev = by_conv[r.conversation_id]
            history = len(prev.prompt) + len(prev.output)
            assert r.retention[-1] == RetentionRange(sys_len, history, 50)
            checked_follow_up = True
        by_conv[r.conversation_id] = r
    assert checked_follow_up
    none = WorkloadConfig(seed=12, system_prompt_priority=None, conversation_priority=None)
    assert all(r.retention == () for r in WorkloadGenerator(none).take(50))


def test_held_out_requests_do_not_advance_the_stream_and_continue_its_conversations() -> None:
    cfg = WorkloadConfig(seed=13, follow_up_delay_s=0.0)
    gen, twin = WorkloadGenerator(cfg), WorkloadGenerator(cfg)
    served = gen.take(100)
    twin.take(100)
    held = gen.held_out(200, seed=1)
    assert [r.to_json() for r in held] == [r.to_json() for r in gen.held_out(200, seed=1)]
    assert [r.prompt for r in held] != [r.prompt for r in gen.held_out(200, seed=2)]
    assert gen.next_request().to_json() == twin.next_request().to_json()
    assert all(r.request_id >= HELD_OUT_REQUEST_ID_BASE for r in held)
    histories = {}
    for r in served:
        histories[r.conversation_id] = r.prompt + r.output
    continuing = [r for r in held if r.turn > 0]
    assert continuing, "some held-out requests continue ongoing conversations"
    for r in continuing:
        history = histories[r.conversation_id]
        assert r.prompt[: len(history)] == history
    fresh = [r for r in held if r.turn == 0]
    assert fresh and all(
        r.prompt[: len(gen.system_prompt(r.system_prompt))] == gen.system_prompt(r.system_prompt)
        for r in fresh
    )


def test_a_request_survives_json() -> None:
    for r in stream(20, seed=14, lora_ids=(3,), lora_probability=0.5):
        again = Request.from_json(json.loads(json.dumps(r.to_json())))
        assert again == r and again.prompt == r.prompt and again.retention == r.retention
    with pytest.raises(ValueError, match="not a request"):
        Request.from_json({"prompt": [1]})


def test_bad_configs_are_refused_with_the_field_named() -> None:
    for kwargs, name in [
        ({"vocab_size": 1}, "vocab_size"),
        ({"request_rate": 0}, "request_rate"),
        ({"user_tokens": (5, 2)}, "user_tokens"),
        ({"follow_up_probability": 1.5}, "follow_up_probability"),
        ({"system_prompt_priority": 101}, "system_prompt_priority"),
        ({"lora_probability": 0.5}, "lora_ids"),
        ({"max_prompt_tokens": 100}, "max_prompt_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            WorkloadConfig(**kwargs)


def test_derived_seeds_differ_per_part_and_are_stable() -> None:
    assert derive_seed(1, "inst", 0) == derive_seed(1, "inst", 0)
    assert len({derive_seed(1, "inst", r) for r in range(16)}) == 16


def test_each_worker_gets_its_own_stream_over_the_same_content() -> None:
    base = WorkloadConfig(seed=3, content_seed=4)
    a, b = base.for_worker("inst-0", 0), base.for_worker("inst-0", 1)
    assert a.seed != b.seed and a.content_seed == b.content_seed == 4
    assert a == base.for_worker("inst-0", 0) and a != base.for_worker("inst-1", 0)
    ga, gb = WorkloadGenerator(a), WorkloadGenerator(b)
    assert ga.system_prompt(1) == gb.system_prompt(1)
    assert [r.prompt for r in ga.take(20)] != [r.prompt for r in gb.take(20)]
