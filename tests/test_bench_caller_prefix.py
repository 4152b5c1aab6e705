"""``benchmarks/caller_prefix.py`` runs, and its invariants hold: a new session of the
caller starts from another session's parked copy with as many cached tokens as the
bare engine reports for the same messages, and another API key gets none of them."""

from __future__ import annotations

from pathlib import Path

import trio

from benchmarks import caller_prefix


async def test_the_figure_runs_and_keeps_its_invariants(smollm2: Path) -> None:
    with trio.fail_after(300):
        summary = await caller_prefix.main(150, 1, smollm2)
    (run,) = summary["runs"]
    gezel, direct = run["gezel"], run["direct"]
    assert gezel["lent_within_caller"] == 1
    assert gezel["s2"]["cached"] == direct["s2"]["cached"] > 100  # the system prompt
    assert gezel["b1"]["cached"] == 0  # another key: nothing of caller A's
    assert direct["b1"]["cached"] > 100  # where the bare engine, keyless, reuses it
    assert summary["new_session_other_key"]["gezel"]["cached"] == 0
