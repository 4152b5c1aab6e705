"""Hostile and stuck clients against the front end (:mod:`gezel_trio.front_guard`), on real
hypercorn sockets, with raw sockets as clients (no HTTP library between the test and the
wire).

- A client that stops reading a stream but keeps its connection open loses its slot and
  its connection after ``[server] stream_stall_timeout``.
- A slowloris (a head without its final CRLF, trickled or not; half a declared body) is cut
  off after ``keep_alive_timeout`` / ``body_timeout``; so is a keep-alive connection left
  idle after a request.
- SIGINT ends a real host process within ``shutdown_timeout`` (+1 s) while such clients
  are still connected, and stops its engine.
- 500 idle keep-alive connections do not slow other clients, are released as soon as their
  clients close them, and do not delay a shutdown.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gezel_trio.config.schema import Config, ModelConfig, apply_env, validate
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.engine.ports import free_port
from gezel_trio.errors import ConfigError
from gezel_trio.server import Served, drain_timeout, open_served

from .conftest import make_config, pids_alive
from .fault_tools import HttpReply, slots_busy, split_url, wait_nothing_held, wait_until

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "temperature": 0,
    "max_tokens": 16000,
    "ignore_eos": True,
    "stream": True,
}

ROOT = Path(__file__).resolve().parent.parent

SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
"""A request head without its final CRLF: the server waits for the rest of it."""


def _half_body() -> bytes:
    """A complete head declaring 200 bytes of body, and 100 of them."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 200\r\n\r\n" + b"{" + b" " * 99
    )


def _request(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


def _cfg(
    state_dir: Path,
    *,
    tiny_model: Path | None = None,
    engine_binary: EngineBinary | None = None,
    **server: Any,
) -> Config:
    models = []
    if tiny_model is not None:
        models = [ModelConfig(id="tiny", path=str(tiny_model), parallel=1, ctx_per_slot=16384)]
    return make_config(models, state_dir=state_dir, engine_binary=engine_binary, server=server)


@asynccontextmanager
async def _served(cfg: Config) -> AsyncIterator[tuple[Served, httpx.AsyncClient]]:
    async with (
        open_served(cfg) as served,
        httpx.AsyncClient(base_url=served.urls[0], timeout=httpx.Timeout(60.0)) as client,
    ):
        yield served, client


async def _connect(url: str, *, rcvbuf: int | None = None) -> trio.SocketStream:
    """A raw TCP connection to ``url``'s server; a small ``rcvbuf`` (set before the
    handshake, so the window it advertises is small from the start) fills up soon."""
    host, port = split_url(url)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


async def _read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before {marker!r}: {buf[:200]!r}"
        buf += chunk
    return buf


async def _stuck_reader(url: str) -> trio.SocketStream:
    """Send a long streaming chat, read its first event, then read nothing more."""
    stream = await _connect(url, rcvbuf=4096)
    await stream.send_all(_request(CHAT))
    await _read_until(stream, b"data: ")
    return stream


async def _read_to_end(stream: trio.SocketStream) -> tuple[bytes, str]:
    """Everything the server still sends, and how the connection ended: ``"eof"`` or
    ``"reset"``."""
    buf = b""
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return buf, "reset"
        if not chunk:
            return buf, "eof"
        buf += chunk


async def _ends_within(stream: trio.SocketStream, seconds: float) -> tuple[float, bytes, str]:
    """Seconds until the server closes ``stream`` (fails after ``seconds``), what it sent
    meanwhile, and how it closed."""
    t0 = trio.current_time()
    with trio.fail_after(seconds):
        data, how = await _read_to_end(stream)
    return trio.current_time() - t0, data, how


async def _serving_only(
    client: httpx.AsyncClient, served: Served, *, within: float, what: str
) -> None:
    """The host still answers ``client``, whose connection soon is the only one open."""
    r = await client.get("/health")
    assert r.status_code == 200
    await wait_until(lambda: served.front.statistics().open <= 1, within=within, what=what)


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


# --------------------------------------------------------------------------- config


def test_shutdown_and_client_timeouts_are_config_keys() -> None:
    cfg = Config()
    assert cfg.server.shutdown_timeout == 10.0
    assert drain_timeout(cfg) == 8.0  # the last 2 s are kept for parking and engines
    apply_env(
        cfg,
        {
            "GEZEL_SERVER_SHUTDOWN_TIMEOUT": "3",
            "GEZEL_SERVER_KEEP_ALIVE_TIMEOUT": "2.5",
            "GEZEL_SERVER_BODY_TIMEOUT": "7",
        },
    )
    validate(cfg)
    assert (cfg.server.shutdown_timeout, cfg.server.keep_alive_timeout) == (3.0, 2.5)
    assert cfg.server.body_timeout == 7.0
    assert drain_timeout(cfg) == 1.5  # at most half is kept
    for key in ("shutdown_timeout", "keep_alive_timeout", "body_timeout"):
        for bad in ("0", "-1", "nan"):
            broken = Config()
            apply_env(broken, {f"GEZEL_SERVER_{key.upper()}": bad})
            with pytest.raises(ConfigError, match=f"server.{key}: expected a positive"):
                validate(broken)
    with pytest.raises(ConfigError, match="GEZEL_SERVER_SHUTDOWN_TIMEOUT: expected a number"):
        apply_env(Config(), {"GEZEL_SERVER_SHUTDOWN_TIMEOUT": "soon"})


# --------------------------------------------------------------------------- a stuck reader


async def test_a_stuck_reader_loses_its_slot_and_its_connection_after_the_stall_timeout(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    stall = 2.0
    cfg = _cfg(
        state_dir, tiny_model=tiny_model, engine_binary=engine_binary, stream_stall_timeout=stall
    )
    with trio.fail_after(120):
        async with _served(cfg) as (served, client):
            host, front = served.host, served.front
            warm = await client.post(
                "/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}
            )
            assert warm.status_code == 200, warm.text
            stream = await _stuck_reader(served.urls[0])
            try:
                # the client's window is closed and the server's send buffer full: a
                # response write waits on the client
                await wait_until(
                    lambda: front.statistics().oldest_write_s > 0.2,
                    within=30,
                    what="a write blocked on the stuck reader",
                )
                blocked_at = trio.current_time() - front.statistics().oldest_write_s
                await wait_until(
                    lambda: front.statistics().write_timeouts == 1,
                    within=stall + 5,
                    what="the stuck reader's connection reset",
                )
                cut_after = trio.current_time() - blocked_at
                await wait_nothing_held(host, within=5)
                engine = host.models["tiny"].engine
                assert engine.base_url is not None
                base_url = engine.base_url

                async def idle() -> bool:
                    return await slots_busy(base_url) == []

                await wait_until(idle, within=3, what="engine slot idle")
                released_after = trio.current_time() - blocked_at
                # the client sees the reset once it reads what its buffer held
                _, _, how = await _ends_within(stream, 5)
                assert how == "reset"
            finally:
                await stream.aclose()
            assert stall * 0.9 <= cut_after <= stall + 3, cut_after
            assert released_after <= stall + 4, released_after
            stats = front.statistics()
            assert stats.writing == 0 and stats.busy == 0, stats
            print(
                f"stuck reader: connection reset {cut_after:.2f}s and slot free "
                f"{released_after:.2f}s after its write blocked (stall timeout {stall:g}s)"
            )
            # the host still serves
            after = await client.post(
                "/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}
            )
            assert after.status_code == 200, after.text


# --------------------------------------------------------------------------- slowloris


async def test_slowloris_clients_are_cut_off_after_their_deadlines(state_dir: Path) -> None:
    """No engine needed: the head and the body are read before any model is resolved."""
    deadline = 1.5
    cfg = _cfg(state_dir, keep_alive_timeout=deadline, body_timeout=deadline)
    with trio.fail_after(60):
        async with _served(cfg) as (served, client):
            url = served.urls[0]
            results: dict[str, tuple[float, bytes, str]] = {}

            async def head_without_crlf() -> None:
                stream = await _connect(url)
                async with stream:
                    await stream.send_all(SLOW_HEAD)
                    results["head"] = await _ends_within(stream, deadline + 5)

            async def trickled_head() -> None:
                stream = await _connect(url)
                async with stream, trio.open_nursery() as nursery:

                    async def trickle() -> None:
                        for i in range(len(SLOW_HEAD)):
                            try:
                                await stream.send_all(SLOW_HEAD[i : i + 1])
                            except (trio.BrokenResourceError, trio.ClosedResourceError):
                                return
                            await trio.sleep(0.1)  # the client's pace, not a wait

                    nursery.start_soon(trickle)
                    results["trickle"] = await _ends_within(stream, deadline + 5)
                    nursery.cancel_scope.cancel()

            async def half_a_body() -> None:
                stream = await _connect(url)
                async with stream:
                    await stream.send_all(_half_body())
                    results["body"] = await _ends_within(stream, deadline + 5)

            async def idle_after_a_request() -> None:
                # hypercorn restarts its idle timer from the app's task, which quart-trio
                # cancels at the end of every request: unguarded, this one stays forever
                stream = await _connect(url)
                async with stream:
                    await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    await _read_until(stream, b'"ok"}')
                    results["keep-alive"] = await _ends_within(stream, deadline + 5)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(head_without_crlf)
                nursery.start_soon(trickled_head)
                nursery.start_soon(half_a_body)
                nursery.start_soon(idle_after_a_request)

            for name in ("head", "trickle", "keep-alive"):
                took, data, _ = results[name]
                assert deadline * 0.9 <= took <= deadline + 2, (name, took)
                assert data == b"", (name, data)  # no request: nothing to answer
            took, data, _ = results["body"]
            assert deadline * 0.9 <= took <= deadline + 2, took
            assert HttpReply(data).status == 408, data
            for name, (took, _, how) in results.items():
                print(f"{name}: cut off after {took:.2f}s ({how})")

            await _serving_only(client, served, within=2, what="the slowloris connections gone")


async def test_an_answer_given_before_the_body_is_read_is_not_reset_away(
    state_dir: Path,
) -> None:
    """A declared body over ``max_body_bytes`` is answered 413 before it is read, while
    its client is still sending it. What the client sends after the answer is read and
    dropped, and the connection ends with a FIN: a socket closed with unread bytes sends
    a reset instead, which can reach the client before it has read the answer (it saw
    "connection reset" where the 413 said what to fix)."""
    cfg = _cfg(state_dir, max_body_bytes=4096)
    with trio.fail_after(60):
        async with _served(cfg) as (served, client):
            stream = await _connect(served.urls[0])
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
                )
                answer = await _read_until(stream, b"\r\n\r\n")
                reply = HttpReply(answer)
                while len(reply.body) < int(reply.headers["content-length"]):
                    reply = HttpReply(reply.raw + await stream.receive_some(65536))
                assert reply.status == 413, reply
                assert "limit of 4096 bytes" in reply.json()["error"]["message"]
                # the server has closed its side by now; the client goes on sending
                for _ in range(16):
                    await stream.send_all(b" " * 16384)
                await stream.send_eof()
                _, after, how = await _ends_within(stream, 10)
            assert (after, how) == (b"", "eof")  # no reset, nothing more
            await _serving_only(client, served, within=5, what="the lingering connection closed")


# --------------------------------------------------------------------------- shutdown


def _tx_queue(local_port: int, remote_port: int) -> int | None:
    """Bytes the kernel holds unsent or unacknowledged on the TCP socket ``local_port`` ->
    ``remote_port`` (any process's, from ``/proc/net/tcp``); None if there is none."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            if (
                int(local.rsplit(":", 1)[1], 16) == local_port
                and int(remote.rsplit(":", 1)[1], 16) == remote_port
            ):
                return int(queues.split(":")[0], 16)
    return None


def _write_blocked(server_port: int, client_port: int, *, still_for: float = 0.5) -> Any:
    """A predicate: the server's socket to the client holds unsent bytes that have not
    changed for ``still_for`` seconds (its window is shut: the server's write waits)."""
    samples: list[tuple[float, int | None]] = []

    def blocked() -> bool:
        now = time.monotonic()
        queued = _tx_queue(server_port, client_port)
        samples.append((now, queued))
        if not queued:
            samples.clear()
            return False
        if any(q != queued for _, q in samples):
            samples[:] = [(now, queued)]
            return False
        return now - samples[0][0] >= still_for

    return blocked


async def test_sigint_ends_the_host_within_shutdown_timeout_with_hostile_clients_connected(
    tmp_path: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    """``gezel-trio serve`` as systemd runs it: a stuck reader (whose write is blocked, with
    a stall timeout far away), a head without its final CRLF and half a body are connected
    when SIGINT arrives; the process still exits within ``shutdown_timeout`` + 1 s, its
    engine gone and every client's connection closed."""
    shutdown_timeout = 4.0
    port = free_port()
    config = tmp_path / "gezel.toml"
    config.write_text(
        "\n".join(
            [
                "[server]",
                f"port = {port}",
                "stream_stall_timeout = 120",
                "keep_alive_timeout = 120",
                "body_timeout = 120",
                "[engine]",
                f"state_dir = {json.dumps(str(tmp_path / 'state'))}",
                f"binary = {json.dumps(str(engine_binary.path))}",
                "[[models]]",
                'id = "tiny"',
                f"path = {json.dumps(str(tiny_model))}",
                "parallel = 2",
                "ctx_per_slot = 16384",
            ]
        )
        + "\n"
    )
    env = dict(os.environ, GEZEL_SERVER_SHUTDOWN_TIMEOUT=str(shutdown_timeout))
    log_path = tmp_path / "host.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "gezel_trio.cli", "serve", "--config", str(config)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    clients: list[trio.SocketStream] = []
    try:
        with trio.fail_after(120):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:

                async def up() -> bool:
                    assert proc.returncode is None, log_path.read_text()[-3000:]
                    try:
                        return (await client.get("/health")).status_code == 200
                    except httpx.HTTPError:
                        return False

                await wait_until(up, within=60, interval=0.1, what="the host up")
                warm = await client.post(
                    "/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}
                )
                assert warm.status_code == 200, warm.text
                (engine,) = (await client.get("/api/status")).json()["engines"]
                engine_pid = engine["pid"]

            stuck = await _stuck_reader(url)
            clients.append(stuck)
            client_port = stuck.socket.getsockname()[1]
            await wait_until(
                _write_blocked(port, client_port),
                within=30,
                interval=0.05,
                what="the host's write to the stuck reader blocked",
            )
            head = await _connect(url)
            clients.append(head)
            await head.send_all(SLOW_HEAD)
            body = await _connect(url)
            clients.append(body)
            await body.send_all(_half_body())

            t0 = trio.current_time()
            proc.send_signal(signal.SIGINT)
            with trio.move_on_after(shutdown_timeout + 5):
                await proc.wait()
            took = trio.current_time() - t0
            assert proc.returncode == 0, (took, log_path.read_text()[-3000:])
            assert took <= shutdown_timeout + 1, (took, log_path.read_text()[-3000:])
            assert pids_alive([engine_pid]) == []
            log = log_path.read_text()
            # the stuck reader and half a body were reset by the shutdown (the slow head,
            # idle, was closed at once); the host's own figure is in its last line
            assert "reset 2 client connections still open at shutdown" in log, log[-3000:]
            assert '"msg": "stopped"' in log, log[-3000:]
            for stream in clients:
                await _ends_within(stream, 2)  # closed, not left hanging
            print(f"SIGINT to exit: {took:.2f}s (shutdown_timeout {shutdown_timeout:g}s)")
    finally:
        for stream in clients:
            await stream.aclose()
        if proc.returncode is None:
            proc.kill()
            with trio.move_on_after(10, shield=True):
                await proc.wait()


# --------------------------------------------------------------------------- idle connections


async def _timed_gets(client: httpx.AsyncClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.get("/health")
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200
    return sorted(out)


async def test_500_idle_connections_do_not_slow_other_clients_or_the_shutdown(
    state_dir: Path,
) -> None:
    idle_n = 500
    _raise_fd_limit(4 * idle_n + 256)  # both ends of every connection live in this process
    cfg = _cfg(state_dir, shutdown_timeout=6.0)
    idle: list[trio.SocketStream] = []
    try:
        with trio.fail_after(120):
            async with _served(cfg) as (served, client):
                url, front = served.urls[0], served.front
                await _timed_gets(client, 10)  # warm
                before = await _timed_gets(client, 40)

                limit = trio.CapacityLimiter(32)

                async def open_idle(i: int) -> None:
                    async with limit:
                        stream = await _connect(url)
                        idle.append(stream)
                        if i % 2:  # half have been served once and sit in keep-alive
                            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                            await _read_until(stream, b'"ok"}')

                async with trio.open_nursery() as nursery:
                    for i in range(idle_n):
                        nursery.start_soon(open_idle, i)
                await wait_until(
                    lambda: front.statistics().open >= idle_n + 1,
                    within=10,
                    what="every idle connection accepted",
                )
                during = await _timed_gets(client, 40)
                assert front.statistics().open >= idle_n + 1  # still held, none dropped
                base, loaded = before[len(before) // 2], during[len(during) // 2]
                print(
                    f"GET /health median {base * 1000:.2f} ms alone, {loaded * 1000:.2f} ms "
                    f"with {idle_n} idle connections (x{loaded / base:.2f})"
                )
                assert loaded <= 4 * base + 0.005, (before, during)

                # clients that close their end free the server's side at once (hypercorn
                # would keep each until its keep-alive timer ran out)
                gone, idle[:] = idle[: idle_n // 2], idle[idle_n // 2 :]
                for stream in gone:
                    await stream.aclose()
                await wait_until(
                    lambda: front.statistics().open <= len(idle) + 1,
                    within=5,
                    what="closed connections released",
                )
                t0 = trio.current_time()
            took = trio.current_time() - t0  # idle connections close at once, no drain
            assert took < drain_timeout(cfg), took
            print(f"shutdown with {len(idle)} idle connections: {took:.2f}s")
            assert front.statistics().open == 0
            assert front.statistics().reset_at_shutdown == 0
    finally:
        for stream in idle:
            await stream.aclose()


# --------------------------------------------------------------------------- the benchmark


async def test_the_hostile_connections_benchmark_runs_and_its_figures_hold(
    tmp_path: Path, engine_binary: EngineBinary
) -> None:
    """``python -m benchmarks.hostile_connections --quick``: it runs, and what it measures
    stays within the deadlines it sets (not a timing test: the bounds are the deadlines)."""
    env = dict(
        os.environ,
        GEZEL_BENCH_RESULTS=str(tmp_path),
        GEZEL_LLAMA_SERVER=str(engine_binary.path),
    )
    with trio.fail_after(300):
        done = await trio.run_process(
            [sys.executable, "-m", "benchmarks.hostile_connections", "--quick"],
            cwd=ROOT,
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    print(done.stdout.decode())
    r = json.loads((tmp_path / "hostile_connections.json").read_text())
    s = r["settings"]
    stall, deadline = s["stream_stall_timeout"], s["keep_alive_timeout"]
    assert stall * 0.9 <= r["stuck_reader"]["slot_free_s"] <= stall + 3
    assert stall * 0.9 <= r["stuck_reader"]["connection_reset_s"] <= stall + 3
    for cut in r["slowloris"].values():
        assert deadline * 0.9 <= cut <= deadline + 2
    assert r["shutdown_s"] <= s["shutdown_timeout"]
    assert r["reset_at_shutdown"] >= 2  # the stuck reader and half a body
    assert r["idle"]["held_during"] >= r["idle"]["idle_connections"]


async def test_an_engine_that_hangs_at_shutdown_is_killed_within_shutdown_timeout(
    state_dir: Path, tiny_model: Path, engine_binary: EngineBinary
) -> None:
    """A keyed chat's KV to park and an engine that answers nothing and ignores SIGTERM
    (SIGSTOPped): parking is cut and the engine killed within what is left of
    ``shutdown_timeout``, although ``stop_grace`` and ``park_on_stop_timeout`` (10 s
    each by default) are longer."""
    cfg = _cfg(state_dir, tiny_model=tiny_model, engine_binary=engine_binary, shutdown_timeout=3.0)
    assert cfg.engine.stop_grace > 3 and cfg.scheduler.park_on_stop_timeout > 3
    pid = None
    try:
        with trio.fail_after(60):
            async with _served(cfg) as (served, client):
                chat = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hello world"}],
                    "max_tokens": 2,
                    "prompt_cache_key": "to-park",
                }
                assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
                pid = served.host.models["tiny"].engine.pid
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                began = trio.current_time()
            took = trio.current_time() - began
        assert took <= cfg.server.shutdown_timeout + 1.0, took
        assert pids_alive([pid]) == []
    finally:
        if pid is not None and pids_alive([pid]):
            os.kill(pid, signal.SIGKILL)
