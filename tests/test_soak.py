"""The soak (:mod:`benchmarks.soak`): its judge, a one-minute smoke, and the long form.

- ``first_divergence`` and the report's aims are plain functions: tested here directly.
- ``test_soak_quick`` runs ``python -m benchmarks.soak --quick`` (about a minute: a real
  host in swap mode with two models, both reference engines, walk-aways, one SIGKILL, one
  SIGSTOP/SIGCONT and one hang, two idle releases) and asserts that every aim was met and
  that each kind of traffic and fault actually happened.
- ``test_soak_long`` (soak mode, not in CI: ``pytest -m soak``) runs it for
  ``GEZEL_SOAK_MINUTES`` (default 2) minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.soak import QuietPoint, SoakReport, first_divergence
from gezel_trio.engine.binary import EngineBinary

ROOT = Path(__file__).resolve().parent.parent
MINUTES = float(os.environ.get("GEZEL_SOAK_MINUTES", "2"))


def _step(token: str, logprob: float, *others: tuple[str, float]) -> dict[str, Any]:
    tops = [{"token": token, "logprob": logprob}] + [
        {"token": t, "logprob": lp} for t, lp in others
    ]
    return {"token": token, "logprob": logprob, "top_logprobs": tops}


def test_first_divergence_finds_a_near_tie() -> None:
    # measured on the small demo model: the host picked the runner-up 0.008 nats behind
    ref = [_step("0", -0.0), _step(" ov", -0.6948, ("\r", -0.703)), _step(" questio", 0.0)]
    d = first_divergence("0\r requesl", ref)
    assert d == {"token": 1, "ref": " ov", "host": "\r", "gap": 0.0082}


def test_first_divergence_of_a_confident_token_has_no_gap() -> None:
    ref = [_step("0", -0.0), _step(" ov", -0.01, ("T", -5.0)), _step(" questio", 0.0)]
    # the host's text continues with a token the reference gave no weight to
    assert first_divergence("0 hello", ref)["gap"] is None
    # a runner-up far behind is a gap, and too large to be a tie
    assert first_divergence("0T", ref)["gap"] == pytest.approx(4.99)
    # the host said more than the reference: diverges after the reference's last token
    assert first_divergence("0 ov questio more", ref) == {
        "token": 3,
        "ref": "",
        "host": " more",
        "gap": None,
    }


def test_report_misses_name_each_aim() -> None:
    ok = QuietPoint(t=1, label="q", drained_in=0.1, stuck=None, idle_released_in=3, rss=100, fds=9)
    report = SoakReport(settings={}, requests=10, completed=8, quiet_points=[ok, ok])
    assert report.misses(rss_slack_pct=10, fd_slack=8) == []
    grown = QuietPoint(t=2, label="q2", drained_in=0.1, stuck="queued=1", idle_released_in=None,
                       rss=120, fds=30)  # fmt: skip
    report = SoakReport(
        settings={}, requests=10, completed=8, lost=1, contaminated=2, quiet_points=[ok, grown]
    )
    misses = " | ".join(report.misses(rss_slack_pct=10, fd_slack=8))
    for part in ("1 lost", "2 contaminated", "RSS grew 20.0%", "descriptors grew by 21",
                 "queued=1", "not idle-released"):  # fmt: skip
        assert part in misses


def _soak(
    tmp_path: Path, engine_binary: EngineBinary, *args: str, timeout: float
) -> dict[str, Any]:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.soak",
            *args,
            "--engine-binary",
            str(engine_binary.path),
            "--out",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert out.exists(), proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert proc.returncode == 0, report["aims_missed"]
    return report


def _assert_exercised(report: dict[str, Any]) -> None:
    assert report["aims_missed"] == []
    assert report["lost"] == 0 and report["contaminated"] == 0 and report["duplicated"] == 0
    assert report["unverified"] == 0 and report["checked"] == report["completed"] > 50
    kinds = report["by_kind"]
    assert kinds["session"]["completed"] > 0 and kinds["chat"]["completed"] > 0
    assert report["walked_away"] > 0
    counts = report["fault_counts"]
    assert counts.get("kill", 0) >= 1 and counts.get("stop", 0) >= 1
    assert counts.get("hang", 0) >= 1
    assert report["engine_crashes"] >= 1  # the kill at least
    assert report["swaps"] > 0 and report["idle_releases"] == len(report["quiet_points"]) >= 2
    assert report["rss_growth_pct"] <= 10 and report["host_alive"]


def test_soak_quick(tmp_path: Path, engine_binary: EngineBinary) -> None:
    report = _soak(tmp_path, engine_binary, "--quick", timeout=420)
    assert report["settings"]["quick"] is True
    _assert_exercised(report)


@pytest.mark.soak
def test_soak_long(tmp_path: Path, engine_binary: EngineBinary) -> None:
    report = _soak(tmp_path, engine_binary, "--minutes", str(MINUTES), timeout=MINUTES * 60 + 600)
    _assert_exercised(report)
