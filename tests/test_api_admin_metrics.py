"""Auth, admin endpoints, /metrics and the OpenAPI document, against a real hypercorn socket."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from gezel_trio.api.app import create_app
from gezel_trio.api.errors import OLLAMA_PATHS, dialect_of
from gezel_trio.config.schema import Config, ModelConfig
from gezel_trio.engine.binary import EngineBinary
from gezel_trio.gpu.probe import GpuReading
from gezel_trio.host import Host
from gezel_trio.host.metrics import Metrics
from gezel_trio.host.snapshot import HostSnapshot
from gezel_trio.server import exposure_warning

from . import _snapshots as snapshots
from .conftest import make_config, running

API_KEY = "sk-user-0123456789abcdef"
ADMIN_KEY = "sk-admin-fedcba9876543210"
OTHER_KEY = "sk-nobody-5555555555"
ORIGIN_OK = "http://allowed.example"

# The only paths served without a key when keys are set: liveness and the status page's HTML.
PUBLIC = {"/health", "/"}
MODEL_ENDPOINTS = {
    "completions",
    "embeddings",
    "completion",
    "tokenize",
    "detokenize",
    "props",
    "slots",
}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}


def _cfg(tiny_model: Path, state_dir: Path, engine_binary: EngineBinary, **kw: Any) -> Any:
    return make_config(
        [
            ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=512),
            ModelConfig(id="tiny2", path=str(tiny_model), parallel=1, ctx_per_slot=256),
        ],
        state_dir=state_dir,
        engine_binary=engine_binary,
        **kw,
    )


def _routes(host: Host) -> list[tuple[str, str, str]]:
    """(method, rule, concrete path) for every route the app serves."""
    app = create_app(host)
    out = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?(\w+)>", "tiny", rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            out.append((method, rule.rule, path))
    return out


def _is_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, (resp.request.url, resp.status_code, resp.text)
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err  # type: ignore[no-any-return]


def _is_unauthorized_in_its_dialect(resp: httpx.Response, path: str, rule: str) -> None:
    """A 401 in the shape of the route's own API: Anthropic's under /v1/messages,
    Ollama's on its routes and sd-server's on its own (``{"error": "..."}``), OpenAI's
    everywhere else."""
    dialect = dialect_of(path)
    if dialect == "anthropic":
        assert resp.status_code == 401, (rule, resp.text)
        body = resp.json()
        assert body["type"] == "error", (rule, body)
        assert body["error"]["type"] == "authentication_error", (rule, body)
        assert body["error"]["message"], rule
    elif dialect in ("ollama", "sdcpp"):
        assert resp.status_code == 401, (rule, resp.text)
        assert isinstance(resp.json()["error"], str) and resp.json()["error"], rule
    else:
        err = _is_openai_error(resp, 401)
        assert err["code"] == "invalid_api_key", (rule, err)


def _all_log_text(records: list[logging.LogRecord]) -> str:
    parts = []
    for r in records:
        parts.append(r.getMessage())
        parts.append(json.dumps(getattr(r, "fields", None), default=str))
        if r.exc_text:
            parts.append(r.exc_text)
    return "\n".join(parts)


async def test_auth_matrix_and_keys_never_logged(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = _cfg(
        tiny_model,
        state_dir,
        engine_binary,
        server={"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY], "cors_origins": [ORIGIN_OK]},
    )
    user = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with trio.fail_after(60):
        async with running(cfg) as (host, client):
            routes = _routes(host)
            paths = {p for _, _, p in routes}
            # the endpoints are all there
            for p in (
                "/v1/embeddings",
                "/completion",
                "/upstream/tiny/tokenize",
                "/metrics",
                "/api/config",
                "/openapi.json",
                "/",
            ):
                assert p in paths, p

            for method, rule, path in routes:
                if path in PUBLIC:
                    resp = await client.request(method, path)
                    assert resp.status_code == 200, (path, resp.text)
                    continue
                # no key, a wrong key: 401 in OpenAI's shape, before anything else happens
                for headers in (
                    {},
                    {"Authorization": f"Bearer {OTHER_KEY}"},
                    {"Authorization": "Basic abc"},
                ):
                    resp = await client.request(method, path, headers=headers)
                    _is_unauthorized_in_its_dialect(resp, path, rule)
                if path.startswith("/api/sessions"):
                    # every key may see and remove its own sessions (none yet)
                    resp = await client.request(method, path, headers=user)
                    assert resp.status_code == (200 if method == "GET" else 404), resp.text
                elif path.startswith("/api/") and path not in OLLAMA_PATHS:
                    # a user key is not an admin key (Ollama's routes are model routes)
                    err = _is_openai_error(await client.request(method, path, headers=user), 403)
                    assert err["code"] == "insufficient_permissions"
            # nothing was started by any of that
            assert [rt.engine.pid for rt in host.models.values()] == [None, None]

            # keys that work: user key on the API (also as X-Api-Key), admin key on /api/*
            resp = await client.post("/v1/chat/completions", json=CHAT, headers=user)
            assert resp.status_code == 200, resp.text
            resp = await client.get("/v1/models", headers={"X-Api-Key": API_KEY})
            assert resp.status_code == 200
            for path in ("/metrics", "/openapi.json"):
                assert (await client.get(path, headers=user)).status_code == 200
            status = await client.get("/api/status", headers=admin)
            assert status.status_code == 200
            config = await client.get("/api/config", headers=admin)
            assert config.status_code == 200
            assert config.json()["config"]["server"]["api_keys"] == 1
            logs = await client.get("/api/models/tiny/logs?lines=5", headers=admin)
            assert logs.status_code == 200 and len(logs.json()["lines"]) == 5

            # CORS: no wildcard, only configured origins are echoed
            resp = await client.get("/v1/models", headers={**user, "Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in resp.headers
            resp = await client.get("/v1/models", headers={**user, "Origin": ORIGIN_OK})
            assert resp.headers["access-control-allow-origin"] == ORIGIN_OK

            # keys never appear in what the host says
            for body in (
                status.text,
                config.text,
                (await client.get("/metrics", headers=user)).text,
            ):
                for key in (API_KEY, ADMIN_KEY, OTHER_KEY):
                    assert key not in body
    text = _all_log_text(caplog.records)
    assert "request" in text  # the request log line was captured
    for key in (API_KEY, ADMIN_KEY, OTHER_KEY):
        assert key not in text


async def test_metrics_after_requests(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    with trio.fail_after(60):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (_, client):
            body = {**CHAT, "model": "tiny", "prompt_cache_key": "metrics-session"}
            r1 = await client.post("/v1/chat/completions", json=body)
            assert r1.status_code == 200, r1.text
            usage = r1.json()["usage"]
            # the same prompt again: the engine serves most of it from the slot's KV
            r2 = await client.post("/v1/chat/completions", json=body)
            assert r2.status_code == 200
            usage2 = r2.json()["usage"]
            async with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as s:
                assert s.status_code == 200
                _ = [line async for line in s.aiter_lines()]
            assert (
                await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
            ).status_code == 404

            resp = await client.get("/metrics")
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/plain")
            families = {f.name: f for f in text_string_to_metric_families(resp.text)}

    def value(name: str, suffix: str = "", **labels: str) -> float:
        fam = families[name]
        found = [
            s.value
            for s in fam.samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, (name, suffix, labels, fam.samples)
        return found[0]

    assert value("gezel_requests", "_total", model="tiny", status="200") == 3
    assert value("gezel_requests", "_total", model="(unresolved)", status="404") == 1
    assert value("gezel_request_duration_seconds", "_count", model="tiny") == 3
    # every completion has a TTFT, streamed or not (the host streams from the engine)
    assert value("gezel_ttft_seconds", "_count", model="tiny") == 3
    prompt = value("gezel_prompt_tokens", "_total", model="tiny")
    assert prompt >= usage["prompt_tokens"] + usage2["prompt_tokens"]
    cached = value("gezel_cached_prompt_tokens", "_total", model="tiny")
    assert cached >= usage2["prompt_tokens_details"]["cached_tokens"] > 0
    assert value("gezel_completion_tokens", "_total", model="tiny") >= (
        usage["completion_tokens"] + usage2["completion_tokens"]
    )
    assert value("gezel_queue_depth") == 0
    assert value("gezel_engine_state", model="tiny", state="ready") == 1
    assert value("gezel_engine_state", model="tiny2", state="stopped") == 1
    assert value("gezel_engine_starts", "_total", model="tiny") == 1
    assert value("gezel_engine_crashes", "_total", model="tiny") == 0
    # event series exist even before their first event
    for name in ("gezel_slot_erases", "gezel_engine_restarts", "gezel_lease_wait_seconds"):
        assert name in families, name


def test_metrics_collector_reads_status_at_scrape_time() -> None:
    """GPU, queue, engine and calibration series come from status(); events from the methods."""
    status = snapshots.host(
        version="9.9",
        uptime_s=12.5,
        scheduler=snapshots.scheduler(
            queued=3,
            max_queue=8,
            waiting_model_ids={"a": 2, "b": 1},
            running={"a": 1},
            erases={"ok": 4, "failed": 1},
            parking={"restored": 3, "lent_within_caller": 2},
            slot_owners={"a": {0: "abc", 1: None}},
        ),
        engines=(
            snapshots.model(
                "a",
                state="ready",
                busy=1,
                starts=2,
                crashes=1,
                calibration={"result": "failed", "prompts": 4, "distinct_answers": 3, "at": 1700.0},
            ),
            snapshots.model("b", state="failed", busy=0, starts=1, crashes=1),
        ),
        gpu=snapshots.gpu(GpuReading(0, "H200", 61.0, 1_000, 4_000, utilization_pct=55)),
    )
    m = Metrics(status=lambda: status)
    m.request_done("a", 200, 0.5, 0.1, 10, 6, 4)
    m.request_done("a", 503, 0.01)
    m.erase("a", True)
    m.erase("a", False)
    m.engine_restart("b")
    m.lease_wait(2.0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }

    def v(series: str, **labels: str) -> float:
        return samples[(series, tuple(sorted(labels.items())))]

    assert v("gezel_requests_total", model="a", status="200") == 1
    assert v("gezel_requests_total", model="a", status="503") == 1
    assert v("gezel_ttft_seconds_count", model="a") == 1
    assert v("gezel_request_duration_seconds_count", model="a") == 2
    assert v("gezel_prompt_tokens_total", model="a") == 10
    assert v("gezel_cached_prompt_tokens_total", model="a") == 6
    assert v("gezel_completion_tokens_total", model="a") == 4
    assert v("gezel_slot_erases_total", model="a", result="ok") == 1
    assert v("gezel_slot_erases_total", model="a", result="failed") == 1
    assert v("gezel_engine_restarts_total", model="b") == 1
    assert v("gezel_lease_wait_seconds_count") == 1
    assert v("gezel_lease_wait_seconds_sum") == 2.0
    assert v("gezel_queue_depth") == 3
    assert v("gezel_queue_capacity") == 8
    assert v("gezel_queue_waiting", model="b") == 1
    assert v("gezel_jobs_running", model="a") == 1
    assert v("gezel_scheduler_erases_total", result="failed") == 1
    assert v("gezel_scheduler_parking_total", event="lent_within_caller") == 2
    assert v("gezel_scheduler_parking_total", event="restored") == 3
    assert v("gezel_slots_owned", model="a") == 1
    assert v("gezel_engine_state", model="b", state="failed") == 1
    assert v("gezel_engine_state", model="b", state="ready") == 0
    assert v("gezel_engine_crashes_total", model="a") == 1
    assert v("gezel_gpu_temperature_celsius", gpu="0", name="H200") == 61.0
    assert v("gezel_gpu_memory_used_bytes", gpu="0", name="H200") == 1_000
    assert v("gezel_gpu_memory_total_bytes", gpu="0", name="H200") == 4_000
    assert v("gezel_calibration_result", model="a", result="failed") == 1
    assert v("gezel_calibration_result", model="a", result="passed") == 0
    assert v("gezel_calibration_distinct_answers", model="a") == 3
    assert v("gezel_info", version="9.9") == 1

    # read at scrape time: a change in status shows up in the next scrape
    status = replace(status, gpu=snapshots.gpu(GpuReading(0, "H200", 70.0, 1_000, 4_000)))
    assert 'gezel_gpu_temperature_celsius{gpu="0",name="H200"} 70.0' in m.render().decode()

    # a status that raises costs the state series, never the scrape
    def broken() -> HostSnapshot:
        raise RuntimeError("boom")

    m2 = Metrics(status=broken)
    m2.request_done("x", 200, 1.0)
    text = m2.render().decode()
    assert 'gezel_requests_total{model="x",status="200"} 1.0' in text
    assert "gezel_queue_depth" not in text
    assert m2.statistics().scrape_errors == 1


async def test_put_config_applies_live_and_names_bad_fields(
    tiny_model: Path, state_dir: Path, engine_binary: EngineBinary
) -> None:
    root = logging.getLogger()
    level = root.level
    with trio.fail_after(30):
        async with running(_cfg(tiny_model, state_dir, engine_binary)) as (host, client):
            assert (await client.get("/v1/models/tiny2")).status_code == 200

            resp = await client.put("/api/config", json={"lock_model": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["applied"] == {"lock_model": True}
            err = _is_openai_error(await client.get("/v1/models/tiny2"), 409)
            assert err["code"] == "model_locked"
            err = _is_openai_error(
                await client.post("/v1/chat/completions", json={**CHAT, "model": "tiny2"}), 409
            )
            assert host.models["tiny2"].engine.pid is None

            resp = await client.put(
                "/api/config",
                json={
                    "lock_model": False,
                    "policy": "swap",
                    "temp_limit_c": 80,
                    "temp_margin_c": 4,
                },
            )
            assert resp.status_code == 200, resp.text
            live = (await client.get("/api/status")).json()["config"]
            assert live["lock_model"] is False
            assert live["policy"] == "swap" and live["resolved_policy"] == "swap"
            assert (live["temp_limit_c"], live["temp_margin_c"]) == (80.0, 4.0)
            assert host.config.gpu.temp_limit_c == 80.0
            assert (await client.get("/v1/models/tiny2")).status_code == 200

            try:
                resp = await client.put("/api/config", json={"log_level": "debug"})
                assert resp.status_code == 200
                assert root.level == logging.DEBUG
                assert (await client.get("/api/config")).json()["live"]["log_level"] == "debug"
            finally:
                root.setLevel(level)

            bad = [
                ({"policy": "fastest"}, "policy"),
                ({"lock_model": "yes"}, "lock_model"),
                ({"temp_limit_c": "hot"}, "temp_limit_c"),
                ({"temp_limit_c": 1000}, "temp_limit_c"),
                ({"temp_margin_c": -1}, "temp_margin_c"),
                ({"temp_margin_c": 90}, "temp_margin_c"),
                ({"log_level": "loud"}, "log_level"),
                ({"max_queue": 3}, "max_queue"),
                ({}, "body"),
                ({"policy": "coexist", "lock_model": 1}, "lock_model"),
            ]
            for patch, field in bad:
                err = _is_openai_error(await client.put("/api/config", json=patch), 400)
                assert err["param"] == field, (patch, err)
                assert field in err["message"]
            err = _is_openai_error(
                await client.put(
                    "/api/config", content=b"{nope", headers={"content-type": "application/json"}
                ),
                400,
            )
            # nothing of the bad patches was applied
            live = (await client.get("/api/status")).json()["config"]
            assert live["policy"] == "swap" and live["lock_model"] is False
            assert live["temp_limit_c"] == 80.0


async def test_openapi_document_matches_the_routes(state_dir: Path) -> None:
    """Every served route is documented, and nothing else is (no engine needed)."""
    async with running(make_config([], state_dir=state_dir)) as (host, client):
        spec = (await client.get("/openapi.json")).json()
        routes = _routes(host)
    assert spec["openapi"].startswith("3.1")
    documented = {
        (method.upper(), path)
        for path, ops in spec["paths"].items()
        for method in ops
        if method in ("get", "post", "put", "delete", "patch")
    }
    served = {(m, re.sub(r"<(?:[a-z]+:)?(\w+)>", r"{\1}", rule)) for m, rule, _ in routes}
    assert documented == served
    for path, ops in spec["paths"].items():
        params = set(re.findall(r"{(\w+)}", path))
        for method, op in ops.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == params, (path, method)
            codes = set(op["responses"])
            assert "200" in codes, (path, method)
            if path in PUBLIC:
                assert op["security"] == []
            else:
                assert "401" in codes, (path, method)
            if (
                path.startswith("/api/")
                and not path.startswith("/api/sessions")
                and path not in OLLAMA_PATHS
            ):
                assert "403" in codes, (path, method)  # admin only
            if "{model" in path:
                assert "404" in codes, (path, method)
            if path.rsplit("/", 1)[-1] in MODEL_ENDPOINTS:
                assert {"400", "404", "409", "502", "503", "504"} <= codes, (path, method)
    refs = re.findall(r'"#/components/schemas/(\w+)"', json.dumps(spec))
    assert refs and all(r in spec["components"]["schemas"] for r in refs)


def test_exposure_defaults() -> None:
    """Loopback by default; a warning for any other bind without keys."""
    cfg = Config()
    assert cfg.server.host == "127.0.0.1" and exposure_warning(cfg) is None
    cfg.server.host = "0.0.0.0"
    warning = exposure_warning(cfg)
    assert warning is not None and "api_keys" in warning
    cfg.server.api_keys = [API_KEY]
    assert exposure_warning(cfg) is None
    assert cfg.server.cors_origins == []


def test_calibration_series_read_the_runtime_state_shape() -> None:
    """What /api/status really carries per engine: the verdict in "status", the probe's
    figures nested under "result", and the restarts after a failed probe."""
    status = snapshots.host(
        engines=(
            snapshots.model(
                "rec",
                calibration={
                    "status": "failed",
                    "runs": 1,
                    "restarts_after_failure": 1,
                    "result": {
                        "verdict": "failed",
                        "prompts_tried": 5,
                        "distinct_answers": 2,
                        "finished_at": 1800.0,
                    },
                },
            ),
        )
    )
    m = Metrics(status=lambda: status)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }
    assert samples[("gezel_calibration_result", (("model", "rec"), ("result", "failed")))] == 1
    assert samples[("gezel_calibration_result", (("model", "rec"), ("result", "passed")))] == 0
    assert samples[("gezel_calibration_prompts", (("model", "rec"),))] == 5
    assert samples[("gezel_calibration_distinct_answers", (("model", "rec"),))] == 2
    assert samples[("gezel_calibration_timestamp_seconds", (("model", "rec"),))] == 1800.0
    assert samples[("gezel_calibration_restarts", (("model", "rec"),))] == 1
