"""benchmarks/images.py runs in a small form and its figures hold their invariants: the
render-time comparison, and the ``swap`` timeline (each kind waits for the other, the
ledger's bytes against the engines' resident memory). Real sd-server and llama-server;
the figures themselves are the benchmark's business, not asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.images import render_time, swap_timeline
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.demo_image_model import DemoImageModel, demo_image_model_path


@pytest.fixture(scope="module")
def image_model(models_dir: Path) -> DemoImageModel:
    return demo_image_model_path(cache_dir=models_dir)


def test_render_time_compares_host_and_direct(
    image_model: DemoImageModel, sd_server_binary: EngineBinary
) -> None:
    out = render_time(image_model, runs=1, steps=2, size="64x48")
    assert [len(out["seconds"][k]) for k in ("direct", "host")] == [1, 1]
    med = out["median_s"]
    assert med["direct"] > 0 and med["host"] > 0
    assert out["ratio_host_over_direct"] == pytest.approx(med["host"] / med["direct"])


def test_swap_timeline_each_kind_waits_for_the_other(
    image_model: DemoImageModel, sd_server_binary: EngineBinary, engine_binary: EngineBinary
) -> None:
    out = swap_timeline(image_model, steps=2, size="64x48")
    a, b = out["chat_mid_render"], out["render_mid_chat"]
    # the chat sent mid-render ends after the render; the render sent mid-chat, after it
    assert a["chat_done_after_render_s"] >= 0 and a["chat_sent_after_s"] < a["render_s"]
    assert b["render_done_after_chat_s"] >= 0 and b["render_sent_after_s"] < b["chat_s"]
    assert out["sd_server_crashes"] == 0 and out["sd_server_starts"] >= 2  # evicted, restarted
    img = out["memory"]["img"]
    # after a render the ledger holds what sd-server measured, never less than its RSS then
    assert img["rss_bytes"] and img["ledger_bytes"]
    assert abs(img["ledger_bytes"] - img["rss_bytes"]) <= max(img["rss_bytes"] // 10, 16 << 20)
    assert out["memory"]["tiny"]["ledger_bytes"]
