"""Admin endpoints: status, live config, engine logs, load and unload."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from quart import Blueprint, Response, current_app, request

from ..config.schema import Config, GpuPolicySetting, LogLevel, _coerce, validate
from ..errors import ConfigError, FieldError
from ..host import Host, ModelRuntime
from .errors import json_response
from .validation import read_json_object

log = logging.getLogger("gezel_trio.api")

bp = Blueprint("admin", __name__)


def _host() -> Host:
    host: Host = current_app.config["GEZEL_HOST"]
    return host


@bp.get("/api/status")
async def status() -> Response:
    return json_response(_host().status())


@bp.get("/api/activity")
async def activity() -> Response:
    """The dashboard's feed: the last requests (newest first) and the per-second series
    of queue depth, running jobs and median TTFT over the last ten minutes."""
    return json_response(_host().activity.snapshot().as_dict())


@bp.get("/api/models/<model_id>/logs")
async def logs(model_id: str) -> Response:
    """The last ``lines`` lines (default 200), or with ``since=N`` the lines after the
    N-th ever logged; ``next`` is what to pass as ``since`` to follow the log."""
    host = _host()
    rt = host.resolve_model(model_id, kind=None)
    log_ring = rt.engine.log
    await log_ring.caught_up()  # the lines the engine has written by now
    since = request.args.get("since")
    if since is not None:
        try:
            seq = int(since)
        except ValueError:
            raise FieldError("since", "expected the 'next' number of an earlier answer") from None
        lines, nxt = log_ring.since(max(0, seq))
        return json_response({"model": rt.id, "lines": lines, "next": nxt})
    try:
        n = max(1, min(int(request.args.get("lines", "200")), log_ring.total or 1, 10_000))
    except ValueError:
        n = 200
    return json_response({"model": rt.id, "lines": log_ring.tail(n), "next": log_ring.total})


def _targets(host: Host, model_id: str) -> list[ModelRuntime]:
    """The engines an admin call on ``model_id`` acts on: every member of a replicated
    model (in order), else the one model (404 for an unknown id)."""
    return host.replica_members(model_id) or [host.resolve_model(model_id, kind=None)]


def _answer(model_id: str, done: list[dict[str, Any]]) -> Response:
    """One engine's answer as it is. A replicated model's lists each member's under
    ``members``, with ``model`` its id and ``state`` its members' states (one word when
    they agree, e.g. ``ready``; else each distinct one, e.g. ``ready, failed``)."""
    if not _host().replica_members(model_id):
        return json_response(done[0])
    states = list(dict.fromkeys(str(d.get("state")) for d in done))
    body: dict[str, Any] = {"model": model_id, "members": done}
    if all("state" in d for d in done):
        body["state"] = ", ".join(states)
    return json_response(body)


@bp.post("/api/models/<model_id>/load")
async def load(model_id: str) -> Response:
    """Make the model resident as a request would (in swap mode this evicts the others,
    their sessions parked first) and wait until its engine is ready; every member of
    a replicated model, one after another."""
    done = []
    for rt in _targets(_host(), model_id):
        await rt.ensure_resident()
        done.append({"model": rt.id, "state": rt.engine.state.value.value})
    return _answer(model_id, done)


@bp.post("/api/models/<model_id>/unload")
async def unload(model_id: str) -> Response:
    """Stop the model's engine (every member's, for a replicated model), its sessions
    parked first."""
    done = []
    for rt in _targets(_host(), model_id):
        await rt.engine.stop()
        done.append({"model": rt.id, "state": rt.engine.state.value.value})
    return _answer(model_id, done)


@bp.post("/api/reload")
async def reload_config() -> Response:
    """Re-read the config file and apply its models (as SIGHUP does): 200 with what was
    added, removed, changed; 400 naming the key when the file is invalid (nothing
    changes)."""
    return json_response(await _host().reload())


@bp.post("/api/models/<model_id>/calibrate")
async def calibrate(model_id: str) -> Response:
    """Run the co-batch calibration now, as an exclusive operation; answer its result.
    A replicated model calibrates each engine the host runs, one at a time, every
    replica drained for each (external members are not calibrated by this host)."""
    host = _host()
    targets = [rt for rt in _targets(host, model_id) if not rt.config.external]
    if not targets:
        raise FieldError("model_id", "an external engine is not calibrated by this host")
    done = []
    for rt in targets:
        result = await host.calibrate(rt)
        done.append(
            {"model": rt.id, "admission_ceiling": rt.parallel, "reason": rt.ceiling_reason} | result
        )
    return _answer(model_id, done)


@bp.post("/api/models/<model_id>/benchmark")
async def benchmark(model_id: str) -> Response:
    """Measure prefill/decode speed alone on the drained engine (an exclusive op): a
    text model's (an image model is WrongModelKind, 400)."""
    host = _host()
    rt = host.resolve_model(model_id)
    args = request.args
    try:
        prompt_tokens = int(args.get("prompt_tokens", "256"))
        n_predict = int(args.get("n_predict", "32"))
    except ValueError as exc:
        raise FieldError("prompt_tokens", "prompt_tokens and n_predict must be integers") from exc
    ctx = rt.ctx_per_slot or 0
    if not 1 <= prompt_tokens <= ctx - n_predict or n_predict < 1:
        raise FieldError(
            "prompt_tokens",
            f"need 1 <= n_predict and prompt_tokens + n_predict <= {ctx}",
        )
    result = await host.benchmark(rt, prompt_tokens=prompt_tokens, n_predict=n_predict)
    return json_response({"model": rt.id, **result})


# ------------------------------------------------------------------ live configuration

# What ``PUT /api/config`` may change, the type each value must have, and
# where it lives in the config.
SETTABLE: dict[str, tuple[Any, str]] = {
    "policy": (GpuPolicySetting, "gpu.policy"),
    "temp_limit_c": (float, "gpu.temp_limit_c"),
    "temp_margin_c": (float, "gpu.temp_margin_c"),
    "lock_model": (bool, "scheduler.lock_model"),
    "log_level": (LogLevel, "server.log_level"),
}
# Keys this module applies itself; the others go to ``Host.apply_config``.
SELF_APPLIED = frozenset({"log_level"})
"""Applied here only when the host has no ``apply_config``."""


def validate_config_patch(config: Config, patch: dict[str, Any]) -> dict[str, Any]:
    """Check a ``PUT /api/config`` body against the live config.

    The body is flat: ``{"policy": "swap", "temp_limit_c": 80, "temp_margin_c": 5,
    "lock_model": true, "log_level": "debug"}``, any subset but not none.
    Returns the patch with values coerced (ints to floats where a number is
    expected). Raises :class:`FieldError` (400) naming the first bad key;
    nothing is applied then.
    """
    if not patch:
        raise FieldError("body", f"expected at least one of {', '.join(SETTABLE)}")
    out: dict[str, Any] = {}
    for key, value in patch.items():
        spec = SETTABLE.get(key)
        if spec is None:
            raise FieldError(
                str(key)[:100], f"cannot change live; settable keys: {', '.join(SETTABLE)}"
            )
        tp, _ = spec
        try:
            out[key] = _coerce(key, value, tp, from_text=False)
        except ConfigError as exc:
            raise FieldError(key, exc.message.split(": ", 1)[-1]) from exc
    limit = out.get("temp_limit_c", config.gpu.temp_limit_c)
    margin = out.get("temp_margin_c", config.gpu.temp_margin_c)
    if not 1.0 <= limit <= 150.0:
        raise FieldError("temp_limit_c", f"expected 1..150 degrees C, got {limit:g}")
    if not 0.0 <= margin < limit:
        key = "temp_margin_c" if "temp_margin_c" in out else "temp_limit_c"
        raise FieldError(
            key, f"expected 0 <= temp_margin_c ({margin:g}) < temp_limit_c ({limit:g})"
        )
    trial = copy.deepcopy(config)
    for key, value in out.items():
        section, _, name = SETTABLE[key][1].partition(".")
        setattr(getattr(trial, section), name, value)
    try:
        validate(trial)
    except ConfigError as exc:
        where, _, why = exc.message.partition(": ")
        raise FieldError(where.rsplit(".", 1)[-1], why or exc.message) from exc
    return out


def config_view(config: Config) -> dict[str, Any]:
    """The live configuration, JSON-ready. Keys are never shown, only how many are set."""
    server = dataclasses.asdict(config.server)
    server["api_keys"] = len(config.server.api_keys)
    server["admin_keys"] = len(config.server.admin_keys)
    models = []
    for m in config.models:
        d = dataclasses.asdict(m)
        if m.url:
            d["url"] = _strip_userinfo(m.url)
        models.append(d)
    return {
        "server": server,
        "engine": dataclasses.asdict(config.engine),
        "scheduler": dataclasses.asdict(config.scheduler),
        "gpu": dataclasses.asdict(config.gpu),
        "models": models,
    }


def live_view(host: Host) -> dict[str, Any]:
    """The settings ``PUT /api/config`` changes, as they are now."""
    out = dict(host.live_config())
    out["log_level"] = host.config.server.log_level
    return out


def _strip_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return scheme + sep + netloc + slash + path


@bp.get("/api/config")
async def get_config() -> Response:
    host = _host()
    return json_response({"live": live_view(host), "config": config_view(host.config)})


@bp.put("/api/config")
async def put_config() -> Response:
    """Apply policy, thermal limits, ``lock_model`` and the log level without a restart.

    The whole patch is validated first (400 naming the key; nothing applied),
    then handed to ``Host.apply_config``.
    """
    host = _host()
    patch = validate_config_patch(host.config, await read_json_object())
    for_host = {k: v for k, v in patch.items() if k not in SELF_APPLIED}
    if for_host:
        host.apply_config(for_host)
    if "log_level" in patch:
        host.config.server.log_level = patch["log_level"]
        logging.getLogger().setLevel(patch["log_level"].upper())
    log.info("config changed", extra={"fields": {"changed": patch}})
    return json_response({"applied": patch, "live": live_view(host)})
