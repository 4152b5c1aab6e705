"""How soon llama-server stops generating after its client closes the connection,
streamed and not: why the host streams every completion from the engine.

    python -m benchmarks.engine_disconnect [--repeats 3]

One llama-server (the host's own resolution, 2 slots) and the generated ``tiny`` model.
Each case sends a long completion (``n_predict`` 3000, ``ignore_eos``) pinned to slot 0
over a raw socket, closes the socket after a pause (0.05 to 2.5 s), then polls ``/slots``
until slot 0 is idle: the time from the close to the idle slot is how long the engine
went on generating for nobody. Cases: ``/completion`` and ``/v1/chat/completions``,
each ``stream`` true and false.

A non-streamed request's close is noticed only when the engine next polls its
connection (seconds, measured below); a streamed one's at its next write. A host that
sent unary requests upstream non-streamed (to keep the connection alive: llama-server
closes it after every streamed answer) would hand the slot of a client that walked away
to the next owner while the engine still generates on it. Writes
benchmarks/results/engine_disconnect.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

import httpx

from ._harness import llama_server_process, median, write_result

PAUSES = (0.05, 0.3, 1.0, 2.5)


def _slot0_busy(base: str) -> bool:
    return bool(httpx.get(base + "/slots", timeout=10).json()[0]["is_processing"])


def _walk_away(port: int, path: str, stream: bool, pause: float) -> float:
    """Seconds from the client's close until slot 0 is idle."""
    body: dict[str, Any] = {"n_predict": 3000, "ignore_eos": True, "stream": stream, "id_slot": 0}
    if path == "/completion":
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "Once upon a time"}]
        body["max_tokens"] = 3000
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode()
    base = f"http://127.0.0.1:{port}"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + raw)
        time.sleep(pause)
        if not _slot0_busy(base):
            raise RuntimeError("slot 0 was not generating when the client left")
        closed = time.perf_counter()
    while _slot0_busy(base):
        if time.perf_counter() - closed > 120:
            raise RuntimeError("slot 0 still generating 120 s after the close")
        time.sleep(0.005)
    return time.perf_counter() - closed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    figures: dict[str, dict[str, float]] = {}
    with llama_server_process(parallel=2, ctx_size=8192) as (port, binary):
        print(f"{'case':36s} {'median s':>9s} {'max s':>7s}  (close -> slot idle)")
        for path in ("/completion", "/v1/chat/completions"):
            for stream in (True, False):
                delays = [
                    _walk_away(port, path, stream, pause)
                    for _ in range(args.repeats)
                    for pause in PAUSES
                ]
                name = f"{path} stream={str(stream).lower()}"
                figures[name] = {"median_s": median(delays), "max_s": max(delays)}
                print(f"{name:36s} {median(delays):9.3f} {max(delays):7.3f}")
    setup = {"binary": str(binary), "repeats": args.repeats, "pauses_s": list(PAUSES)}
    path = write_result("engine_disconnect", {"setup": setup, "cases": figures})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
