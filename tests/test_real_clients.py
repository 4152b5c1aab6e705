"""The coding agents people run, as they ship, on a real model: each against the host with
its defaults (``gezel-trio serve --model smollm2.gguf``, nothing else) and against a bare
``llama-server --jinja`` on the same model.

Each client is configured only the way docs/coming-from.md says (environment variables and
config files in a temp HOME; no login, no network) and talks through a recording proxy
(tests/_recording_proxy.py). Per client and backend the test asserts: the client exits 0
with an answer; every request it made was answered 2xx; the host logged every one of them
(``/api/activity``); and turn 2 read at least 90% of its prompt from cache where the engine
does (the engine's figure is measured in the same test, from its own usage answers).

Then the differential: the requests recorded from both runs are replayed against the host
and against the engine. No request the engine serves may be refused by the host, and both
must count the same prompt tokens. Ollama-route requests have no engine counterpart (bare
llama-server has no Ollama API): they are checked against the host alone.

The clients run one at a time (they are heavy); each turn is bounded by
:data:`TURN_TIMEOUT`. Both engines, the bare one and the host's, run with the same default
output bound (:data:`ENGINE_N_PREDICT`, set as an operator would, through llama.cpp's own
``LLAMA_ARG_N_PREDICT``): Codex asks for no output limit, and SmolLM2 sometimes talks until
its context is full, which with tools in the request slows the engine's stream to a few
tokens a second (a turn of over 300 s). A request that gives its own limit keeps it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from gezel_trio.engine.binary import EngineBinary

from . import _clients as clients
from ._recording_proxy import Exchange, RecordingProxy, open_recording_proxy, prompt_counts
from .conftest import serve_process

pytestmark = pytest.mark.engine

# prefill on a busy 2-core CPU runs at 50-200 tokens/s and these prompts are 0.6k-4.6k
# tokens; a turn may also make several requests (Claude Code continues a cut answer)
TURN_TIMEOUT = 300.0
CACHE_AIM = 0.9
ENGINE_N_PREDICT = "512"
ENGINE_ENV = {"LLAMA_ARG_N_PREDICT": ENGINE_N_PREDICT}
"""The engines' default output bound (see the module's docstring)."""
MODEL_PATHS = (
    "/v1/messages",
    "/v1/responses",
    "/v1/chat/completions",
    "/api/chat",
    "/api/generate",
)
OLLAMA_PATHS = ("/api/",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, f"{url} not healthy: {log.read_text()[-2000:]}"
        time.sleep(0.1)


def _assert_output_bound(host: subprocess.Popen[bytes], url: str) -> None:
    """The host's engine (started by a one-token request) runs with the tests' output
    bound in its environment (``/props`` shows a slot's defaults, not the server's)."""
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    engines = [
        p
        for p in psutil.Process(host.pid).children(recursive=True)
        if "llama-server" in " ".join(p.cmdline())
    ]
    assert engines, "the host runs no llama-server"
    for engine in engines:
        value = engine.environ().get("LLAMA_ARG_N_PREDICT")
        assert value == ENGINE_N_PREDICT, f"the host's engine has LLAMA_ARG_N_PREDICT={value}"


@pytest.fixture(scope="module")
def engine_url(
    engine_binary: EngineBinary, smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A bare ``llama-server -m smollm2.gguf --jinja``: the engine's own truth."""
    port = _free_port()
    log = tmp_path_factory.mktemp("bare") / "llama-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(engine_binary.path), "-m", str(smollm2), "--jinja", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENGINE_ENV},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_health(url, proc, log, 120)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.fixture(scope="module")
def host_url(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``gezel-trio serve --model smollm2.gguf``: the host with its defaults, nothing else."""
    port = _free_port()
    folder = tmp_path_factory.mktemp("host")
    env = {**os.environ, **ENGINE_ENV, "XDG_STATE_HOME": str(folder / "state")}
    args = ["--model", str(smollm2), "--port", str(port), "--log-format", "json"]
    with serve_process(args, port, folder / "host.log", env=env) as host:
        _assert_output_bound(host, f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}"


@dataclass
class Run:
    """One client's conversation against one backend."""

    backend: str
    turns: list[list[Exchange]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # a turn that exited non-zero
    activity: list[dict[str, Any]] = field(default_factory=list)  # the host's rows
    wall_s: float = 0.0

    def model_requests(self, turn: int | None = None) -> list[Exchange]:
        turns = self.turns if turn is None else [self.turns[turn]]
        return [e for t in turns for e in t if e.method == "POST" and _is_model(e.path)]

    def outgrown(self) -> bool:
        """Whether a request was refused for being longer than the context: the 135M
        model, asked for no output limit, sometimes talks until its slot is full, and the
        next turn cannot fit (bare llama-server refuses it the same way)."""
        return any(
            e.status == 400 and b"exceed_context_size_error" in e.response
            for t in self.turns
            for e in t
        )

    def turn2_cache(self) -> tuple[int, int]:
        """(cached, prompt) tokens summed over turn 2's requests: from the host's own
        activity rows on the host, from the engine's usage answers on the engine."""
        if len(self.turns) < 2:
            return 0, 0
        if self.backend == "host":
            rows = self.activity[len(self.model_requests(0)) :]
            return (
                sum(r.get("cached_tokens") or 0 for r in rows),
                sum(r.get("prompt_tokens") or 0 for r in rows),
            )
        counts = [prompt_counts(e.response) for e in self.model_requests(1)]
        return sum(c or 0 for _, c in counts), sum(p or 0 for p, _ in counts)


def _is_model(path: str) -> bool:
    return path.split("?")[0] in MODEL_PATHS


async def _activity(host_url: str) -> list[dict[str, Any]]:
    """The host's activity rows for model requests, oldest first."""
    async with httpx.AsyncClient(timeout=30) as http:
        rows = (await http.get(f"{host_url}/api/activity")).json()["requests"]
    return sorted(
        (r for r in rows if r.get("path") and _is_model(r["path"])), key=lambda r: r["at"]
    )


async def _activity_since(
    host_url: str, before: list[dict[str, Any]], want: int
) -> list[dict[str, Any]]:
    """The rows added since ``before``, once there are ``want`` of them (a streamed
    answer is logged as its body ends, which may be just after the client read its
    last byte), or what there is after 15 s."""
    seen = {(r["at"], r["path"]) for r in before}
    with trio.move_on_after(15):
        while True:
            rows = [r for r in await _activity(host_url) if (r["at"], r["path"]) not in seen]
            if len(rows) >= want:
                break
            await trio.sleep(0.1)
    return rows


async def converse(
    proxy: RecordingProxy,
    *,
    backend: str,
    upstream: str,
    host_url: str,
    commands: list[list[str]],
    env: dict[str, str],
    cwd: Path,
) -> Run:
    """Run ``commands`` (the turns) one after another through ``proxy`` to ``upstream``."""
    run = Run(backend)
    before = await _activity(host_url) if backend == "host" else []
    t0 = time.monotonic()
    for n, argv in enumerate(commands):
        label = f"{backend}/{n}"
        proxy.target(upstream, label)
        done = None
        # files, not pipes: node clients leave children holding their pipes. A client
        # that hangs is killed (run_process does that on cancellation) and counts as a
        # failed turn, so that the figures of the rest still come out
        out_path = cwd.parent / f"turn{n}.out"
        err_path = cwd.parent / f"turn{n}.err"
        with out_path.open("wb") as out_f, err_path.open("wb") as err_f:
            with trio.move_on_after(TURN_TIMEOUT):
                done = await trio.run_process(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    check=False,
                )
        run.turns.append(proxy.recorded(label))
        out = out_path.read_text(errors="replace")
        err = err_path.read_text(errors="replace")
        run.outputs.append(out)
        if done is None:
            run.failures.append(f"turn {n} on {backend}: no answer in {TURN_TIMEOUT:.0f} s")
        elif done.returncode != 0 and not _output_cap_only(out + err):
            run.failures.append(
                f"turn {n} on {backend}: exit {done.returncode}\n{out[-1500:]}\n{err[-1500:]}"
            )
        if run.failures:
            break  # a turn 2 after a failed turn 1 shows nothing more, slowly
    run.wall_s = time.monotonic() - t0
    if backend == "host":
        run.activity = await _activity_since(host_url, before, len(run.model_requests()))
    return run


def _output_cap_only(text: str) -> bool:
    """Claude Code gives up (exit 1) when a 135M model still talks after three
    continuations of a capped answer: the server answered every request; the client's
    own cap (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, set by the test) ended it."""
    return "output token maximum" in text


def check_run(run: Run, client: str) -> None:
    """Every request the client made answered 2xx, an answer, and on the host a logged
    row for every one of them."""
    assert run.model_requests(), f"{client} made no model request on {run.backend}"
    refused = [
        (e.path, e.status, e.response[:400])
        for t in run.turns
        for e in t
        if e.status >= 400 and e.method == "POST"
    ]
    assert not refused, f"{client} on {run.backend}: refused {refused}"
    assert not run.failures, f"{client}: {run.failures[0]}"
    assert any(o.strip() for o in run.outputs), f"{client} printed no answer on {run.backend}"
    if run.backend == "host":
        paths = sorted(e.path.split("?")[0] for e in run.model_requests())
        logged = sorted(r["path"] for r in run.activity)
        assert logged == paths, f"{client}: host logged {logged} for requests {paths}"


async def check_cache(
    host: Run, engine_ratio: float, client: str, engine_url: str | None = None
) -> float:
    """Turn 2 on the host reads from cache at least :data:`CACHE_AIM` of its prompt, or
    as much as the engine reads where the engine itself reads less.

    ``engine_ratio`` is the engine's own run, a conversation of its own: the model
    talks differently each time, and a client that rebuilds its history (Claude Code's
    ``--continue``) diverges from its cache more after a longer answer. When the host
    falls short of it, the engine's truth for the host's very requests decides: they
    are sent to ``engine_url`` in order, and its turn 2 read is the bound."""
    cached, prompt = host.turn2_cache()
    assert prompt > 0, f"{client}: no prompt tokens logged for turn 2 on the host"
    ratio = cached / prompt
    said = f"the engine {engine_ratio:.2f} on its own run"
    if ratio < min(CACHE_AIM, engine_ratio) - 0.05 and engine_url is not None:
        engine_ratio = await _engine_on(host, engine_url)
        said = f"the engine {engine_ratio:.2f} on the host's own requests"
    assert ratio >= min(CACHE_AIM, engine_ratio) - 0.05, (
        f"{client}: turn 2 read {cached}/{prompt} from cache on the host, {said}"
    )
    return ratio


async def _engine_on(run: Run, engine_url: str) -> float:
    """The share of turn 2's prompt tokens that the engine reads from its cache when
    sent ``run``'s model requests, turn 1's then turn 2's, in order."""
    first, second = run.model_requests(0), run.model_requests(1)
    cached = prompt = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(TURN_TIMEOUT), trust_env=False) as http:
        for n, e in enumerate([*first, *second]):
            r = await http.post(engine_url + e.path, headers=e.headers, content=e.body)
            if n >= len(first):
                p, c = prompt_counts(r.content)
                prompt, cached = prompt + (p or 0), cached + (c or 0)
    return cached / prompt if prompt else 0.0


async def replay(
    exchanges: list[Exchange], *, engine_url: str, host_url: str
) -> list[dict[str, Any]]:
    """Each distinct recorded model request (Ollama's excepted: the engine has no such
    route) sent as recorded to the engine and to the host: their statuses and prompt
    token counts."""
    seen: set[tuple[str, bytes]] = set()
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(TURN_TIMEOUT), trust_env=False) as http:
        for e in exchanges:
            key = (e.path, e.body)
            if e.method != "POST" or not _is_model(e.path) or e.path.startswith(OLLAMA_PATHS):
                continue
            if key in seen:
                continue
            seen.add(key)
            row: dict[str, Any] = {"path": e.path}
            for name, base in (("engine", engine_url), ("host", host_url)):
                r = await http.post(base + e.path, headers=e.headers, content=e.body)
                row[name] = r.status_code
                row[f"{name}_prompt"] = prompt_counts(r.content)[0]
                row[f"{name}_body"] = r.content[:300]
            results.append(row)
    return results


def check_replay(results: list[dict[str, Any]], client: str) -> int:
    refused = [r for r in results if r["engine"] < 300 and 400 <= r["host"] < 500]
    assert not refused, f"{client}: the host refused what the engine served: {refused}"
    differ = [
        r
        for r in results
        if r["engine"] < 300
        and r["host"] < 300
        and None not in (r["engine_prompt"], r["host_prompt"])
        and r["engine_prompt"] != r["host_prompt"]
    ]
    assert not differ, f"{client}: prompt token counts differ: {differ}"
    return len(results)


def report(client: str, **figures: object) -> None:
    """One line of figures per client (shown with ``-s``, and in the log of a failure)."""
    print(f"\nFIGURES {client}: {json.dumps(figures, default=str)}")


def _home(tmp_path: Path, name: str) -> tuple[Path, Path]:
    home = tmp_path / f"home-{name}"
    work = home / "work"
    work.mkdir(parents=True)
    return home, work


def _base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}


async def _both(
    client: str,
    tmp_path: Path,
    engine_url: str,
    host_url: str,
    setup: Any,
    commands: list[list[str]],
) -> tuple[Run, Run]:
    """The same two turns against the engine, then the host, each in a fresh HOME that
    ``setup(home, work, url)`` configures (returning the environment)."""
    runs = []
    async with open_recording_proxy() as proxy:
        for backend, upstream in (("engine", engine_url), ("host", host_url)):
            for attempt in range(OUTGROWN_TRIES):
                home, work = _home(tmp_path, f"{client}-{backend}-{attempt}")
                env = setup(home, work, proxy.url)
                run = await converse(
                    proxy,
                    backend=backend,
                    upstream=upstream,
                    host_url=host_url,
                    commands=commands,
                    env=env,
                    cwd=work,
                )
                if not run.outgrown():
                    break
                print(f"{client} on {backend}: the model talked past its context; again")
            runs.append(run)
    return runs[0], runs[1]


OUTGROWN_TRIES = 3
"""Conversations run on a backend until one fits the model's context (see
:meth:`Run.outgrown`); the last one is checked whatever it did."""


def _answered(run: Run, client: str) -> str | None:
    try:
        check_run(run, client)
    except AssertionError as exc:
        return str(exc)
    return None


async def _figures(client: str, engine: Run, host: Run, engine_url: str, host_url: str) -> None:
    """Report the client's figures, then assert: it answered on both, turn 2's cache on
    the host, and the replay of every request it made."""
    engine_problem = _answered(engine, client)
    host_problem = _answered(host, client)
    e_cached, e_prompt = engine.turn2_cache()
    h_cached, h_prompt = host.turn2_cache()
    results = await replay(
        [*engine.model_requests(), *host.model_requests()], engine_url=engine_url, host_url=host_url
    )
    report(
        client,
        engine_answered=engine_problem is None,
        host_answered=host_problem is None,
        engine_turn2_cached=f"{e_cached}/{e_prompt}",
        host_turn2_cached=f"{h_cached}/{h_prompt}",
        engine_wall_s=round(engine.wall_s, 1),
        host_wall_s=round(host.wall_s, 1),
        replayed=len(results),
        host_refused_engine_served=[
            (r["path"], r["host"], r["host_body"])
            for r in results
            if r["engine"] < 300 and 400 <= r["host"] < 500
        ],
        prompt_counts=[(r["engine_prompt"], r["host_prompt"]) for r in results],
    )
    assert engine_problem is None, engine_problem
    assert host_problem is None, host_problem
    await check_cache(host, e_cached / e_prompt if e_prompt else 0.0, client, engine_url)
    check_replay(results, client)


async def test_claude_code(tmp_path: Path, engine_url: str, host_url: str) -> None:
    """``claude -p``, then ``claude -p --continue`` in the same folder."""
    claude = str(clients.client_path("claude"))

    def setup(home: Path, work: Path, url: str) -> dict[str, str]:
        return {
            **_base_env(home),
            **clients.env_of(clients.CLAUDE_ENV, url),
            **clients.CLAUDE_TEST_ENV,
        }

    engine, host = await _both(
        "claude",
        tmp_path,
        engine_url,
        host_url,
        setup,
        [
            [claude, "-p", "Reply with one word: hello."],
            [claude, "-p", "--continue", "Reply with one word: goodbye."],
        ],
    )
    await _figures("claude", engine, host, engine_url, host_url)


async def test_codex(tmp_path: Path, engine_url: str, host_url: str) -> None:
    """``codex exec``, then ``codex exec resume --last``, over the Responses API."""
    codex = str(clients.client_path("codex"))

    def setup(home: Path, work: Path, url: str) -> dict[str, str]:
        (home / ".codex").mkdir()
        (home / ".codex" / "config.toml").write_text(clients.render(clients.CODEX_CONFIG, url))
        return {**_base_env(home), "GEZEL_API_KEY": "none"}

    engine, host = await _both(
        "codex",
        tmp_path,
        engine_url,
        host_url,
        setup,
        [
            [codex, "exec", "--skip-git-repo-check", "Reply with one word: hello."],
            [codex, "exec", "--skip-git-repo-check", "resume", "--last", "Now say goodbye."],
        ],
    )
    await _figures("codex", engine, host, engine_url, host_url)


async def test_opencode(tmp_path: Path, engine_url: str, host_url: str) -> None:
    """``opencode run``, then ``opencode run --continue``."""
    opencode = str(clients.client_path("opencode"))

    def setup(home: Path, work: Path, url: str) -> dict[str, str]:
        (work / "opencode.json").write_text(clients.render(clients.OPENCODE_CONFIG, url))
        return {**_base_env(home), **clients.env_of(clients.OPENCODE_ENV, url)}

    engine, host = await _both(
        "opencode",
        tmp_path,
        engine_url,
        host_url,
        setup,
        [
            [opencode, "run", "Reply with one word: hello."],
            [opencode, "run", "--continue", "Now say goodbye."],
        ],
    )
    await _figures("opencode", engine, host, engine_url, host_url)


def _aider_setup(exports: str) -> Any:
    def setup(home: Path, work: Path, url: str) -> dict[str, str]:
        (work / ".aider.model.metadata.json").write_text(clients.AIDER_METADATA)
        (work / ".aider.model.settings.yml").write_text(clients.AIDER_SETTINGS)
        return {**_base_env(home), **clients.env_of(exports, url)}

    return setup


def _aider_turns(route: str) -> list[list[str]]:
    aider = str(clients.client_path("aider"))
    base = [aider, "--model", f"{route}/smollm2", *clients.AIDER_FLAGS.split()]
    # --restore-chat-history makes turn 2 a continuation of turn 1
    return [
        [*base, "--message", "Reply with one word: hello."],
        [*base, "--restore-chat-history", "--message", "Now say goodbye."],
    ]


async def test_aider(tmp_path: Path, engine_url: str, host_url: str) -> None:
    """aider's ``openai/`` route on both, then its ``ollama_chat/`` route on the host (the
    engine has no Ollama API: its ``openai/`` figure is the engine's truth for both)."""
    engine, host = await _both(
        "aider-openai",
        tmp_path,
        engine_url,
        host_url,
        _aider_setup(clients.AIDER_OPENAI_ENV),
        _aider_turns("openai"),
    )
    async with open_recording_proxy() as proxy:
        home, work = _home(tmp_path, "aider-ollama")
        ollama = await converse(
            proxy,
            backend="host",
            upstream=host_url,
            host_url=host_url,
            commands=_aider_turns("ollama_chat"),
            env=_aider_setup(clients.AIDER_OLLAMA_ENV)(home, work, proxy.url),
            cwd=work,
        )
    e_cached, e_prompt = engine.turn2_cache()
    o_cached, o_prompt = ollama.turn2_cache()
    report(
        "aider-ollama_chat",
        host_turn2_cached=f"{o_cached}/{o_prompt}",
        host_wall_s=round(ollama.wall_s, 1),
        host_refused=[e.status for e in ollama.model_requests() if e.status >= 400],
    )
    problems = []
    try:
        check_run(ollama, "aider ollama_chat")
        # Ollama's route is the host's own: the engine cannot be sent its requests
        await check_cache(ollama, e_cached / e_prompt if e_prompt else 0.0, "aider ollama_chat")
    except AssertionError as exc:
        problems.append(str(exc))
    try:
        await _figures("aider-openai", engine, host, engine_url, host_url)
    except AssertionError as exc:
        problems.append(str(exc))
    assert not problems, "\n".join(problems)


LONG_SYSTEM = " ".join(
    f"Rule {i}: answer briefly, in plain words, and never repeat the question." for i in range(90)
)


async def test_ollama_python_client(engine_url: str, host_url: str) -> None:
    """The ``ollama`` Python client's chat and generate on the host; the same prompts sent
    to the engine's own routes are its truth for the cache."""
    import ollama

    client = ollama.AsyncClient(host=host_url, timeout=TURN_TIMEOUT)
    chat = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "Say hello."},
    ]
    options = {"num_predict": 32, "num_ctx": 16384}  # num_ctx as agents ask: above the slot
    before = await _activity(host_url)
    with trio.fail_after(TURN_TIMEOUT):
        first = await client.chat(model="smollm2", messages=chat, options=options)
        assert first.message.content
        chat += [
            {"role": "assistant", "content": first.message.content},
            {"role": "user", "content": "Now say goodbye."},
        ]
        second = await client.chat(model="smollm2", messages=chat, options=options)
        assert second.message.content
        text = LONG_SYSTEM + "\nQuestion: what is a slot?\nAnswer:"
        g1 = await client.generate(model="smollm2", prompt=text, raw=True, options=options)
        g2 = await client.generate(
            model="smollm2",
            prompt=text + g1.response + "\nQuestion: and a prompt?\nAnswer:",
            raw=True,
            options=options,
        )
        assert g1.response and g2.response
    rows = await _activity_since(host_url, before, 4)
    assert [r["path"] for r in rows] == ["/api/chat"] * 2 + ["/api/generate"] * 2, rows

    # the engine's truth for the same two second turns
    async with httpx.AsyncClient(base_url=engine_url, timeout=TURN_TIMEOUT) as http:
        with trio.fail_after(TURN_TIMEOUT):
            body = {"messages": chat[:2], "max_tokens": 32}
            await http.post("/v1/chat/completions", json=body)
            r = await http.post("/v1/chat/completions", json={**body, "messages": chat})
            e_chat = prompt_counts(r.content)
            await http.post("/completion", json={"prompt": text, "n_predict": 32})
            r = await http.post(
                "/completion",
                json={
                    "prompt": text + g1.response + "\nQuestion: and a prompt?\nAnswer:",
                    "n_predict": 32,
                },
            )
            e_gen = prompt_counts(r.content)
    report(
        "ollama-python",
        engine_chat_turn2=e_chat,
        host_chat_turn2=(rows[1]["prompt_tokens"], rows[1]["cached_tokens"]),
        engine_generate_turn2=e_gen,
        host_generate_turn2=(rows[3]["prompt_tokens"], rows[3]["cached_tokens"]),
    )
    for row, (e_prompt, e_cached) in ((rows[1], e_chat), (rows[3], e_gen)):
        assert e_prompt and e_cached is not None
        engine_ratio = e_cached / e_prompt
        ratio = (row["cached_tokens"] or 0) / row["prompt_tokens"]
        assert ratio >= min(CACHE_AIM, engine_ratio) - 0.05, (row, e_prompt, e_cached)


def test_pinned_clients_are_installed() -> None:
    """The clients under test are the versions pinned here, which tox installs before the
    tests (``python -m tests.install_clients``)."""
    tox = (Path(__file__).resolve().parent.parent / "tox.ini").read_text()
    assert "python -m tests.install_clients" in tox
    for name, (_, _, version) in clients.PINS.items():
        assert clients.installed_version(name) == version, name
