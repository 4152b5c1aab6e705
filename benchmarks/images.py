"""Images through the host: render time against sd-server direct, and a ``swap`` timeline.

    python -m benchmarks.images [--runs 5] [--steps 4] [--size 64x48]

1. **Render time.** The demo image model (``gezel-trio make-model --kind image``), the
   same sd-server binary and flags, the same prompt and size: sd-server run by hand,
   asked on its own ``/v1/images/generations`` (synchronous), against the host's
   ``/v1/images/generations`` (which runs the job through sd-server's async job API
   and polls it). The direct sd-server gets the environment the host gives its own
   (``OMP_WAIT_POLICY=passive``, see :data:`gezel_trio.engine.kinds.SD_SERVER`): on a
   busy machine OpenMP's spinning waits change a render's time several-fold from one
   run to the next, whoever sends it. Both are up at once and asked in turn, after one
   warm-up each; the figure is each one's median and their ratio (host / direct).
2. **A swap timeline.** A host with the generated ``tiny`` text model and the image model
   under ``[gpu] policy = "swap"``: a chat sent while a render samples waits for the
   render's lease (its wait against the render's duration and a chat's own time), then a
   render sent while a long chat generates waits for the chat in the same way.

Writes benchmarks/results/images.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from gezel_trio.engine.binary import resolve_sd_server
from gezel_trio.engine.demo_image_model import DemoImageModel, demo_image_model_path
from gezel_trio.engine.demo_model import write_demo_model
from gezel_trio.engine.kinds import SD_SERVER
from gezel_trio.engine.ports import free_port

from ._harness import RESULTS, host_process, write_result


@contextmanager
def sd_server_process(model: DemoImageModel, steps: int) -> Iterator[str]:
    """sd-server run by hand with the demo model; yields its base URL once it answers."""
    binary = resolve_sd_server()
    port = free_port()
    argv = [str(binary.path), *model.server_args(), "--listen-ip", "127.0.0.1"]
    argv += ["--listen-port", str(port), "--steps", str(steps)]
    proc = subprocess.Popen(
        argv,
        env=SD_SERVER.environment(binary.launch_env()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sd-server did not answer: {argv}")
            time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(20)


def _image_model(model: DemoImageModel, steps: int) -> dict[str, Any]:
    return {
        "id": "img",
        "kind": "image",
        "files": {
            "diffusion_model": str(model.diffusion_model),
            "llm": str(model.llm),
            "taesd": str(model.vae),
        },
        "args": ["--steps", str(steps)],
    }


def _render(client: httpx.Client, url: str, size: str, **extra: Any) -> float:
    body = {"prompt": "a red apple", "size": size, "n": 1, **extra}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/images/generations", json=body)
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    return took


def render_time(model: DemoImageModel, *, runs: int, steps: int, size: str) -> dict[str, Any]:
    with (
        sd_server_process(model, steps) as direct,
        host_process([_image_model(model, steps)]) as (host, _),
        httpx.Client(timeout=600) as client,
    ):
        _render(client, direct, size)
        _render(client, host, size, model="img")  # starts the host's sd-server
        times: dict[str, list[float]] = {"direct": [], "host": []}
        for i in range(runs):
            order = ("direct", "host") if i % 2 == 0 else ("host", "direct")
            for name in order:
                if name == "direct":
                    times[name].append(_render(client, direct, size))
                else:
                    times[name].append(_render(client, host, size, model="img"))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "runs": runs,
        "steps": steps,
        "size": size,
        "seconds": times,
        "median_s": med,
        "ratio_host_over_direct": med["host"] / med["direct"],
    }


def _status(client: httpx.Client, base: str) -> dict[str, Any]:
    engines = client.get(base + "/api/status").json()["engines"]
    return {e["model"]: e for e in engines}


def _wait(what: str, predicate: Callable[[], bool], within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {within:g}s")
        time.sleep(0.02)


def swap_timeline(model: DemoImageModel, *, steps: int, size: str) -> dict[str, Any]:
    tiny = write_demo_model(RESULTS / "tmp" / "tiny.gguf", size="tiny")
    models = [
        {"id": "tiny", "path": str(tiny), "parallel": 1, "ctx_per_slot": 4096},
        _image_model(model, steps),
    ]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24}
    long_chat = {**chat, "max_tokens": 3000, "ignore_eos": True}
    out: dict[str, Any] = {}
    with (
        host_process(models, extra='[gpu]\npolicy = "swap"') as (base, _),
        httpx.Client(timeout=600) as client,
    ):
        # each alone, its engine resident: what a wait is measured against
        _render(client, base, size, model="img")
        out["render_alone_s"] = _render(client, base, size, model="img")
        client.post(base + "/v1/chat/completions", json=chat)  # evicts sd-server
        t0 = time.perf_counter()
        client.post(base + "/v1/chat/completions", json=chat)
        out["chat_alone_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        client.post(base + "/v1/chat/completions", json=long_chat)
        out["long_chat_alone_s"] = time.perf_counter() - t0

        # a chat arrives mid-render
        done: dict[str, float] = {}

        def render() -> None:
            _render(client, base, size, model="img", steps=steps * 2)
            done["render"] = time.perf_counter()

        thread = threading.Thread(target=render)
        render_sent = time.perf_counter()
        thread.start()
        _wait(
            "render sampling",
            lambda: (_status(client, base)["img"].get("job") or {}).get("step", 0) >= 1,
        )
        chat_sent = time.perf_counter()
        r = client.post(base + "/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        chat_done = time.perf_counter()
        thread.join()
        out["chat_mid_render"] = {
            "render_s": done["render"] - render_sent,
            "chat_sent_after_s": chat_sent - render_sent,
            "chat_wait_and_run_s": chat_done - chat_sent,
            "chat_done_after_render_s": chat_done - done["render"],
        }

        # a render arrives mid-chat
        def chat_thread() -> None:
            client.post(base + "/v1/chat/completions", json=long_chat)
            done["long chat"] = time.perf_counter()

        thread = threading.Thread(target=chat_thread)
        chat_sent = time.perf_counter()
        thread.start()
        _wait("chat running", lambda: _status(client, base)["tiny"].get("busy", 0) > 0)
        render_sent = time.perf_counter()
        _render(client, base, size, model="img")
        render_done = time.perf_counter()
        thread.join()
        out["render_mid_chat"] = {
            "chat_s": done["long chat"] - chat_sent,
            "render_sent_after_s": render_sent - chat_sent,
            "render_wait_and_run_s": render_done - render_sent,
            "render_done_after_chat_s": render_done - done["long chat"],
        }
        engines = _status(client, base)
        out["sd_server_starts"] = engines["img"]["starts"]
        out["sd_server_crashes"] = engines["img"]["crashes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", default="64x48")
    args = ap.parse_args()
    model = demo_image_model_path(cache_dir=RESULTS / "tmp")
    timing = render_time(model, runs=args.runs, steps=args.steps, size=args.size)
    med = timing["median_s"]
    print(
        f"render {args.size}, {args.steps} steps, median of {args.runs}: direct "
        f"{med['direct']:.3f} s, host {med['host']:.3f} s, host/direct "
        f"{timing['ratio_host_over_direct']:.3f}"
    )
    timeline = swap_timeline(model, steps=args.steps, size=args.size)
    a, b = timeline["chat_mid_render"], timeline["render_mid_chat"]
    print(
        f"swap: a chat sent {a['chat_sent_after_s']:.2f} s into a {a['render_s']:.2f} s render "
        f"finished {a['chat_wait_and_run_s']:.2f} s after it was sent, "
        f"{a['chat_done_after_render_s']:.2f} s after the render (a chat alone: "
        f"{timeline['chat_alone_s']:.2f} s)"
    )
    print(
        f"swap: a render sent {b['render_sent_after_s']:.2f} s into a {b['chat_s']:.2f} s chat "
        f"finished {b['render_wait_and_run_s']:.2f} s after it was sent, "
        f"{b['render_done_after_chat_s']:.2f} s after the chat (a render alone: "
        f"{timeline['render_alone_s']:.2f} s)"
    )
    path = write_result("images", {"render_time": timing, "swap_timeline": timeline})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
