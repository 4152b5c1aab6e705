"""Soak mode (not in CI): ``pytest -m soak``; ``GEZEL_SOAK_MINUTES`` sets the length (2).

Replays the synthetic agentic trace against a real host process for the whole
time (see :mod:`benchmarks.soak`) and asserts that nothing was lost and nothing
leaked: no failed request, file descriptors back where they were, RSS growth
under 100 MiB, no engine restart. A second run SIGKILLs the engine every 20 s
and asserts the host recovers each time and the descriptors still do not leak.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from benchmarks._harness import host_process
from benchmarks.soak import SoakReport, model_vocab, soak, synthetic_trace
from gezel_trio.engine.binary import EngineBinary

pytestmark = pytest.mark.soak

MINUTES = float(os.environ.get("GEZEL_SOAK_MINUTES", "2"))


def _run(tiny_model: Path, engine_binary: EngineBinary, *, kill_every: float | None) -> SoakReport:
    models = [{"id": "tiny", "path": str(tiny_model), "parallel": 4, "ctx_per_slot": 2048}]
    extra = f'binary = "{engine_binary.path}"'
    with host_process(models, extra=extra) as (base, proc):
        report: SoakReport = trio.run(
            lambda: soak(
                base_url=base,
                host_pid=proc.pid,
                trace=synthetic_trace(),
                minutes=MINUTES,
                concurrency=8,
                sample_every=2.0,
                kill_every=kill_every,
                vocab_hi=model_vocab(tiny_model),
            )
        )
    print(report.summary())
    return report


def test_soak_loses_nothing_and_leaks_nothing(
    tiny_model: Path, engine_binary: EngineBinary
) -> None:
    report = _run(tiny_model, engine_binary, kill_every=None)
    assert report.passes >= 2 and report.requests > 0
    assert report.lost == 0, report.lost_examples
    assert report.fd_growth <= 4, report.summary()
    assert report.rss_growth < 100 * 1024 * 1024, report.summary()
    assert report.restarts == 0 and report.crashes == 0, report.summary()


def test_soak_with_engine_kills_recovers_every_time(
    tiny_model: Path, engine_binary: EngineBinary
) -> None:
    report = _run(tiny_model, engine_binary, kill_every=20.0)
    assert report.kills >= 1
    assert report.crashes == report.kills and report.restarts >= report.kills, report.summary()
    # only requests in flight at a kill may fail
    assert report.lost <= report.kills * 8, report.lost_examples
    assert report.fd_growth <= 4, report.summary()
