"""The one exception-group unwrap, and every ``open_*`` boundary that uses it."""

from __future__ import annotations

import errno
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from gezel_trio._trio import unwrap, unwrapping
from gezel_trio.config.schema import Config
from gezel_trio.engine.supervisor import open_engine
from gezel_trio.errors import EngineCrashed, GezelError, NoCapacity
from gezel_trio.gpu.ledger import open_ledger
from gezel_trio.server import ListenError, open_server, serve_host, serve_until_signalled

from .conftest import make_config


async def a_cancelled() -> trio.Cancelled:
    """A real Cancelled (it has no public constructor)."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            return exc
    raise AssertionError("not cancelled")


def raise_boom() -> None:
    raise ValueError("boom")


async def failing_task() -> None:
    raise_boom()


async def test_unwrap_finds_the_first_real_leaf_of_nested_groups() -> None:
    cancelled = await a_cancelled()
    boom, later = ValueError("boom"), KeyError("later")
    group = BaseExceptionGroup(
        "outer",
        [BaseExceptionGroup("inner", [cancelled, ExceptionGroup("deep", [boom])]), later],
    )
    assert unwrap(group) is boom
    assert unwrap(ExceptionGroup("flat", [later, boom])) is later


async def test_unwrap_of_only_cancellations_is_a_cancelled() -> None:
    first, second = await a_cancelled(), await a_cancelled()
    group = BaseExceptionGroup("all cancelled", [BaseExceptionGroup("inner", [first]), second])
    assert unwrap(group) is first


async def test_unwrap_lets_an_interrupt_through_whatever_else_failed() -> None:
    """A Ctrl-C during a bench replay stops it; it is not reported as one more failed
    request among the others (and the harness does not go on to the next target)."""
    boom, interrupt, leaving = ValueError("boom"), KeyboardInterrupt(), SystemExit(3)
    group = BaseExceptionGroup("replay", [boom, BaseExceptionGroup("inner", [interrupt])])
    assert unwrap(group) is interrupt
    assert unwrap(group, several=lambda leaves: RuntimeError(repr(leaves))) is interrupt
    assert unwrap(BaseExceptionGroup("exit", [boom, leaving])) is leaving


async def test_unwrapping_raises_the_leaf_itself_with_its_traceback() -> None:
    with pytest.raises(ValueError, match=r"^boom$") as info:
        async with unwrapping(), trio.open_nursery() as nursery:
            nursery.start_soon(failing_task)
            await trio.sleep_forever()
    exc = info.value
    assert type(exc) is ValueError and exc.args == ("boom",)
    frames = traceback.extract_tb(exc.__traceback__)
    assert [f.name for f in frames][-2:] == ["failing_task", "raise_boom"]
    assert exc.__cause__ is None and exc.__context__ is None  # the group is not chained
    assert "ExceptionGroup" not in "".join(traceback.format_exception(exc))


async def test_unwrapping_keeps_the_leafs_own_cause() -> None:
    async def fails_from() -> None:
        try:
            raise OSError(errno.EIO, "disk")
        except OSError as exc:
            raise NoCapacity("no room") from exc

    with pytest.raises(NoCapacity) as info:
        async with unwrapping(), trio.open_nursery() as nursery:
            nursery.start_soon(fails_from)
    assert isinstance(info.value.__cause__, OSError)
    assert isinstance(info.value.__context__, OSError)


async def test_unwrapping_passes_everything_else_through() -> None:
    error = KeyError("plain")
    with pytest.raises(KeyError) as info:
        async with unwrapping():
            raise error
    assert info.value is error
    async with unwrapping():
        pass


async def test_cancelled_nursery_leaves_as_a_cancelled_its_scope_catches() -> None:
    with trio.CancelScope() as scope:
        async with unwrapping(), trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_real_error_wins_over_the_cancellations_it_caused() -> None:
    with pytest.raises(ValueError, match="boom"):
        async with unwrapping(), trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(failing_task)
            await trio.sleep_forever()


async def test_unwrapping_decorates_a_coroutine_function() -> None:
    @unwrapping()
    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(failing_task)

    with pytest.raises(ValueError, match="boom"):
        await serve()
    with pytest.raises(ValueError, match="boom"):  # a fresh context manager each call
        await serve()


# The boundaries: a plain project error escapes, not a group.


async def test_open_ledger_unwraps(tmp_path: Path) -> None:
    async def deny() -> None:
        raise NoCapacity("gpu:0: no room")

    with pytest.raises(NoCapacity, match="no room"):
        async with (
            open_ledger(tmp_path / "ledger.sqlite", capacities={"cpu": 1 << 30}),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(deny)


async def test_open_engine_unwraps() -> None:
    http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, json={"status": "ok"}))
    )
    with pytest.raises(EngineCrashed, match="went away"):
        async with open_engine(key="ext", model_id="ext", http=http, url="http://192.0.2.1:9/"):
            raise EngineCrashed("engine went away")


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def server_config(state_dir: Path, port: int = 0) -> Config:
    cfg = make_config([], state_dir=state_dir)
    cfg.server.port = port
    return cfg


async def test_open_server_unwraps_an_error_from_the_block(state_dir: Path) -> None:
    with pytest.raises(GezelError, match="from the block"):
        async with open_server(server_config(state_dir)):
            raise GezelError("from the block")


async def test_open_server_on_a_taken_port_is_a_listen_error(
    state_dir: Path, taken_port: int
) -> None:
    with pytest.raises(ListenError) as info:
        async with open_server(server_config(state_dir, taken_port)):
            raise AssertionError("served on a taken port")
    assert info.value.errno == errno.EADDRINUSE
    assert info.value.message == (
        f"cannot listen on 127.0.0.1:{taken_port}: address already in use; "
        "choose another [server] port or --port"
    )


async def test_serve_host_unwraps(state_dir: Path, taken_port: int) -> None:
    with pytest.raises(ListenError, match=f"127.0.0.1:{taken_port}"):
        await serve_host(server_config(state_dir, taken_port))


async def test_serve_until_signalled_unwraps(state_dir: Path, taken_port: int) -> None:
    with pytest.raises(ListenError, match=f"127.0.0.1:{taken_port}"):
        await serve_until_signalled(server_config(state_dir, taken_port))
