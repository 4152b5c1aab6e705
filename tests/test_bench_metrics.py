"""Benchmark metrics, checked against numbers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gezel_bench.metrics import (
    RequestRecord,
    SessionTurn,
    cache_hit_by_turn,
    jain_index,
    percentile,
    ratios,
    self_reusable_tokens,
    summarize,
)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    rng = np.random.default_rng(1)
    for n in (2, 7, 100):
        xs = list(rng.exponential(size=n))
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_jain_index() -> None:
    assert jain_index([2.0, 2.0, 2.0]) == 1.0
    assert jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / 20)
    assert jain_index([]) is None
    assert jain_index([0.0, 0.0]) == 1.0


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(
            session="a",
            turn=0,
            ttft=0.1,
            itl=[0.02, 0.04],
            e2el=0.2,
            prompt_tokens_sent=10,
            prompt_tokens=10,
            cached_tokens=0,
            output_tokens_requested=3,
            output_tokens=3,
            oracle_tokens=0,
            self_reusable_tokens=0,
        ),
        RequestRecord(
            session="a",
            turn=1,
            ttft=0.3,
            itl=[0.02],
            e2el=0.4,
            prompt_tokens_sent=20,
            prompt_tokens=20,
            cached_tokens=12,
            output_tokens_requested=2,
            output_tokens=2,
            oracle_tokens=10,
            self_reusable_tokens=13,
        ),
        RequestRecord(
            session="b",
            turn=0,
            ttft=0.6,
            itl=[],
            e2el=0.65,
            prompt_tokens_sent=8,
            prompt_tokens=9,  # the engine counted one more: a mismatch
            cached_tokens=4,  # nothing of its own to reuse: cross-session
            output_tokens_requested=2,
            output_tokens=1,
            oracle_tokens=0,
            self_reusable_tokens=0,
            retries=1,
        ),
        RequestRecord(session="b", turn=1, prompt_tokens_sent=12, error="HTTP 500"),
    ]


def test_summarize_by_hand() -> None:
    m = summarize(_records(), duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1 and m["duration"] == 2.0
    assert m["total_input_tokens"] == 10 + 20 + 9
    assert m["total_output_tokens"] == 3 + 2 + 1
    assert m["request_throughput"] == pytest.approx(3 / 2)
    assert m["output_throughput"] == pytest.approx(6 / 2)
    assert m["total_token_throughput"] == pytest.approx(45 / 2)

    # TTFT 100, 300, 600 ms
    assert m["mean_ttft_ms"] == pytest.approx(1000 / 3)
    assert m["median_ttft_ms"] == pytest.approx(300)
    assert m["p99_ttft_ms"] == pytest.approx(300 + 300 * 0.98)
    mean = 1000 / 3
    std = math.sqrt(((100 - mean) ** 2 + (300 - mean) ** 2 + (600 - mean) ** 2) / 3)
    assert m["std_ttft_ms"] == pytest.approx(std)
    # ITL 20, 40, 20 ms; E2EL 200, 400, 650 ms; TPOT (200-100)/2 and (400-300)/1
    assert m["mean_itl_ms"] == pytest.approx(80 / 3)
    assert m["median_itl_ms"] == pytest.approx(20)
    assert m["median_e2el_ms"] == pytest.approx(400)
    assert m["mean_e2el_ms"] == pytest.approx(1250 / 3)
    assert m["mean_tpot_ms"] == pytest.approx(75)

    assert m["cached_tokens"] == 16
    assert m["cache_hit_ratio"] == pytest.approx(16 / 39)
    assert m["oracle_hit_ratio"] == pytest.approx(10 / 38)
    assert m["cache_efficiency"] == pytest.approx((16 / 39) / (10 / 38))
    assert m["cross_session_reuse"] == 4  # 0 + max(0, 12 - 13) + (4 - 0)
    assert m["prompt_token_mismatch"] == 1
    assert m["output_token_mismatch"] == 1
    assert m["cache_unreported"] == 0
    # per-session mean TTFT: a = 0.2, b = 0.6 -> (0.8)^2 / (2 * 0.4)
    assert m["fairness"] == pytest.approx(0.8)
    assert m["sessions"] == 2 and m["retries"] == 1


def test_summarize_falls_back_to_the_oracle_and_handles_nothing() -> None:
    r = RequestRecord(
        session="a",
        turn=1,
        ttft=0.1,
        e2el=0.1,
        prompt_tokens_sent=10,
        cached_tokens=7,
        output_tokens_requested=1,
        output_tokens=1,
        oracle_tokens=5,
    )
    m = summarize([r], duration=1.0)
    assert m["cross_session_reuse"] == 2  # no self bound: the oracle stands in
    assert m["cache_hit_ratio"] == pytest.approx(0.7)  # engine prompt count absent: sent
    empty = summarize([], duration=0.0)
    assert empty["completed"] == 0 and empty["request_throughput"] == 0.0
    assert empty["mean_ttft_ms"] is None and empty["cache_hit_ratio"] is None
    assert empty["cache_efficiency"] is None and empty["fairness"] is None


def test_self_reusable_tokens_by_hand() -> None:
    got = self_reusable_tokens(
        [
            SessionTurn("s", 0, [1, 2, 3], [7, 8], 2),
            SessionTurn("s", 1, [1, 2, 3, 7, 9, 9], None, 4),  # prompt 0 + 1 output token
            SessionTurn("s", 2, [1, 2, 5], [1], 1),  # 2 shared with either
            SessionTurn("s", 3, [1, 2, 3], [], 0),  # 3 shared, capped at 3 - 1
            SessionTurn("t", 0, [1, 2, 3, 7, 8], None, 1),  # another session: nothing
        ]
    )
    assert got == {("s", 0): 0, ("s", 1): 4, ("s", 2): 2, ("s", 3): 2, ("t", 0): 0}
    # without output ids, a whole-prefix predecessor is assumed to match its outputs
    unknown = self_reusable_tokens(
        [SessionTurn("u", 0, [1, 2], None, 2), SessionTurn("u", 1, [1, 2, 5, 6, 7, 8], None, 1)]
    )
    assert unknown[("u", 1)] == 4


def test_self_reusable_tokens_follow_send_times() -> None:
    """Open loop: a later turn sent before an earlier one ended counts for it, and a
    turn sent after a request ended does not."""
    turns = [
        SessionTurn("s", 0, [4, 4, 4], [], 0, t_sent=0.0, t_end=5.0),
        SessionTurn("s", 1, [4, 4, 4, 4], [], 0, t_sent=1.0, t_end=2.0),
        SessionTurn("s", 2, [4, 4, 4, 4, 4], [], 0, t_sent=3.0, t_end=4.0),
        SessionTurn("s", 3, [4, 4], [], 0, t_sent=9.0, t_end=None),  # failed: ends any time
    ]
    assert self_reusable_tokens(turns) == {
        ("s", 0): 2,  # turns 1 and 2 were sent before it ended (capped at 3 - 1)
        ("s", 1): 3,  # turn 0 (3 tokens); turn 2 was sent after it ended
        ("s", 2): 4,  # turns 0 and 1; turn 3 was sent at 9.0, after it ended at 4.0
        ("s", 3): 1,  # everything before it; capped at 2 - 1
    }


def test_cache_hit_by_turn_and_ratios() -> None:
    rows = cache_hit_by_turn(_records())
    assert rows == [
        {"turn": 0, "requests": 2, "cache_hit_ratio": 4 / 19, "oracle_hit_ratio": 0.0},
        {"turn": 1, "requests": 1, "cache_hit_ratio": 12 / 20, "oracle_hit_ratio": 10 / 20},
    ]
    assert ratios({"x": 2.0, "y": 0, "z": None}, {"x": 1.0, "y": 3, "z": 1}, ["x", "y", "z"]) == {
        "x": 0.5,
        "y": None,
        "z": None,
    }


def test_record_json_is_in_milliseconds() -> None:
    j = _records()[0].to_json()
    assert j["ttft_ms"] == 100.0 and j["itl_ms"] == [20.0, 40.0] and j["e2el_ms"] == 200.0
    assert j["error"] is None and j["cached_tokens"] == 0
