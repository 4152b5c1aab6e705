"""Prometheus metrics: event counters the host feeds, plus a collector read at scrape time.

Two kinds of series:

- **Events** the host reports as they happen (:meth:`Metrics.request_done`,
  :meth:`Metrics.erase`, :meth:`Metrics.engine_restart`,
  :meth:`Metrics.lease_wait`): counters and histograms in this object's own
  :class:`~prometheus_client.CollectorRegistry` (never the global one, so two
  hosts in one process, as in tests, never share series).
- **State**, read from the host's typed snapshot (``Host.snapshot``, a
  :class:`~gezel_trio.host.snapshot.HostSnapshot`, the same one ``/api/status``
  shows) at scrape time by :class:`StatusCollector`: queue depth, running jobs,
  engine states and counts, KV parking, replica routing, GPU temperature and
  memory, calibration results.

Rendering is ``prometheus_client.generate_latest``; nothing here formats text.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..gpu.probe import DeviceHealth
from ..scheduler import SchedulerStats
from .snapshot import HostSnapshot, ModelStats, ReplicaSetStats

log = logging.getLogger("gezel_trio.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ENGINE_STATES = ("stopped", "starting", "ready", "stopping", "failed")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LEASE_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

SnapshotFn = Callable[[], HostSnapshot]


class Metrics:
    """The host's metrics. Methods are cheap, synchronous and never raise on bad input.

    ``status`` (usually ``host.snapshot``) is called at every scrape; leave it
    ``None`` for event series only.
    """

    def __init__(self, *, status: SnapshotFn | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gezel_requests",
            "Requests answered, by model and HTTP status.",
            ("model", "status"),
            registry=r,
        )
        self.duration = Histogram(
            "gezel_request_duration_seconds",
            "Time from the request's arrival to the end of its answer.",
            ("model",),
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "gezel_ttft_seconds",
            "Time to first token: from the request's arrival to the engine's first token.",
            ("model",),
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gezel_prompt_tokens", "Prompt tokens, cached or not.", ("model",), registry=r
        )
        self.cached_tokens = Counter(
            "gezel_cached_prompt_tokens",
            "Prompt tokens served from the engine's KV or prompt cache (cache hits).",
            ("model",),
            registry=r,
        )
        self.completion_tokens = Counter(
            "gezel_completion_tokens", "Generated tokens.", ("model",), registry=r
        )
        self.erases = Counter(
            "gezel_slot_erases",
            "Slot KV erases before a handoff to another session, by result.",
            ("model", "result"),
            registry=r,
        )
        self.restarts = Counter(
            "gezel_engine_restarts",
            "Engine restarts after a crash or a failed health check.",
            ("model",),
            registry=r,
        )
        self.lease_waits = Histogram(
            "gezel_lease_wait_seconds",
            "Time spent waiting for a GPU lease.",
            buckets=LEASE_WAIT_BUCKETS,
            registry=r,
        )
        self.kv_ops = Histogram(
            "gezel_kv_operation_seconds",
            "Time of one KV save or restore (parking), by model and operation.",
            ("model", "op"),
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.kv_stop_parks = Histogram(
            "gezel_kv_stop_park_seconds",
            "Time a planned engine stop spent saving its sessions before SIGTERM.",
            ("model",),
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.images = Counter(
            "gezel_images_generated",
            "Images an image model rendered (a job of n images counts n).",
            ("model",),
            registry=r,
        )
        self.status_collector: StatusCollector | None = None
        if status is not None:
            self.status_collector = StatusCollector(status)
            r.register(self.status_collector)
        self._recorded = 0

    def __repr__(self) -> str:
        return f"<Metrics {self._recorded} requests recorded>"

    # ------------------------------------------------------------------ events

    def request_done(
        self,
        model: str,
        status: int,
        duration_s: float,
        ttft_s: float | None = None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """Record one finished request (any status). ``None`` means "not known"."""
        self._recorded += 1
        self.requests.labels(model, str(status)).inc()
        if _finite(duration_s) and duration_s >= 0:
            self.duration.labels(model).observe(duration_s)
        if ttft_s is not None and _finite(ttft_s) and ttft_s >= 0:
            self.ttft.labels(model).observe(ttft_s)
        for counter, value in (
            (self.prompt_tokens, prompt_tokens),
            (self.cached_tokens, cached_tokens),
            (self.completion_tokens, completion_tokens),
        ):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                counter.labels(model).inc(value)

    def erase(self, model: str, ok: bool) -> None:
        """Record one slot erase (``ok`` False: it failed and was only logged)."""
        self.erases.labels(model, "ok" if ok else "failed").inc()

    def engine_restart(self, model: str) -> None:
        """Record one engine restart after a crash."""
        self.restarts.labels(model).inc()

    def images_done(self, model: str, count: int) -> None:
        """Record the images of one completed render."""
        if count > 0:
            self.images.labels(model).inc(count)

    def lease_wait(self, seconds: float) -> None:
        """Record how long a job or engine waited for its GPU lease."""
        if _finite(seconds) and seconds >= 0:
            self.lease_waits.observe(seconds)

    def kv_park(self, model: str, op: str, seconds: float) -> None:
        """Record one KV save or restore (``op``: ``save`` or ``restore``)."""
        if _finite(seconds) and seconds >= 0:
            self.kv_ops.labels(model, op).observe(seconds)

    def kv_stop_park(self, model: str, seconds: float) -> None:
        """Record the time a planned stop spent parking sessions before its SIGTERM."""
        if _finite(seconds) and seconds >= 0:
            self.kv_stop_parks.labels(model).observe(seconds)

    # ------------------------------------------------------------------ output

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (takes one snapshot)."""
        return bytes(generate_latest(self.registry))

    def statistics(self) -> MetricsStatistics:
        collector = self.status_collector
        return MetricsStatistics(
            requests_recorded=self._recorded,
            scrapes=collector.scrapes if collector else 0,
            scrape_errors=collector.errors if collector else 0,
        )


@dataclass(frozen=True, slots=True)
class MetricsStatistics:
    """Requests recorded as events, and scrapes of the state series (and how many failed)."""

    requests_recorded: int
    scrapes: int
    scrape_errors: int

    def as_dict(self) -> dict[str, int]:
        return {
            "requests_recorded": self.requests_recorded,
            "scrapes": self.scrapes,
            "scrape_errors": self.scrape_errors,
        }


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: object) -> float | None:
    """``v`` as a float when it is a finite number or a bool, else None."""
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if _finite(v):
        return float(v)  # type: ignore[arg-type]
    return None


class StatusCollector:
    """A custom collector: turns one :class:`HostSnapshot` into gauges and counters.

    A snapshot that raises yields no state series for that scrape (logged and
    counted in ``errors``); the event series are unaffected.
    """

    def __init__(self, snapshot: SnapshotFn) -> None:
        self._snapshot = snapshot
        self.scrapes = 0
        self.errors = 0

    def __repr__(self) -> str:
        return f"<StatusCollector {self.scrapes} scrapes, {self.errors} errors>"

    def describe(self) -> Iterable[Metric]:
        # Unchecked: the series depend on what the snapshot holds at scrape time.
        return []

    def collect(self) -> Iterator[Metric]:
        self.scrapes += 1
        try:
            families = list(_families(self._snapshot()))
        except Exception:
            self.errors += 1
            log.warning("reading the host's snapshot for /metrics failed", exc_info=True)
            return
        yield from families


def _families(snap: HostSnapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily("gezel_info", "The host's version (always 1).", labels=["version"])
    info.add_metric([snap.version], 1.0)
    yield info
    uptime = _num(snap.uptime_s)
    if uptime is not None:
        yield GaugeMetricFamily(
            "gezel_uptime_seconds", "Seconds since the host started.", value=uptime
        )
    if snap.scheduler is not None:
        yield from _scheduler_families(snap.scheduler)
    yield from _replica_families(snap.replicas)
    yield from _engine_families(snap.engines)
    if snap.gpu is not None:
        yield from _gpu_families(snap.gpu)
    yield from _calibration_families(snap.engines)


def _labelled(
    family: GaugeMetricFamily | CounterMetricFamily, values: Mapping[str, float]
) -> GaugeMetricFamily | CounterMetricFamily:
    """``family`` with one sample per ``{label: number}`` (non-finite numbers left out)."""
    for label, n in values.items():
        v = _num(n)
        if v is not None:
            family.add_metric([label], v)
    return family


def _per_model_gauge(name: str, doc: str, values: Mapping[str, int]) -> Iterator[Metric]:
    """One gauge family with a ``model`` label, from ``{model: number}``; nothing if empty."""
    if values:
        yield _labelled(GaugeMetricFamily(name, doc, labels=["model"]), values)


def _scheduler_families(sched: SchedulerStats) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "gezel_queue_depth", "Requests waiting in the scheduler's queue.", value=sched.queued
    )
    yield GaugeMetricFamily(
        "gezel_queue_capacity", "The scheduler's queue bound.", value=sched.max_queue
    )
    yield from _per_model_gauge(
        "gezel_queue_waiting", "Queued requests per model.", sched.waiting_model_ids
    )
    yield from _per_model_gauge(
        "gezel_jobs_running", "Admitted jobs not yet finished, per model.", sched.running
    )
    if sched.erases:
        yield _labelled(
            CounterMetricFamily(
                "gezel_scheduler_erases",
                "Slot erase decisions made by the scheduler, by result.",
                labels=["result"],
            ),
            sched.erases,
        )
    if sched.parking:
        yield _labelled(
            CounterMetricFamily(
                "gezel_scheduler_parking",
                "KV parking and handoff events the scheduler counted (saved, restored, "
                "handoffs, shared_within_caller, lent_within_caller, ...), by event.",
                labels=["event"],
            ),
            sched.parking,
        )
    if sched.pool:
        yield _labelled(
            CounterMetricFamily(
                "gezel_replica_jobs_moved",
                "Queued jobs a replica did not run itself: failover (it went down) or pooled "
                "(a sibling with a free slot took it).",
                labels=["why"],
            ),
            sched.pool,
        )
    if sched.slot_owners:
        fam = GaugeMetricFamily(
            "gezel_slots_owned", "Slots whose KV belongs to a session, per model.", labels=["model"]
        )
        for model, slots in sched.slot_owners.items():
            fam.add_metric([model], float(sum(1 for o in slots.values() if o)))
        yield fam


def _replica_families(replicas: Mapping[str, ReplicaSetStats]) -> Iterator[Metric]:
    """Per replicated model: requests routed to each member, chats moved, and prefix
    routing per member (hits, misses, shed, blocks matched)."""
    if not replicas:
        return
    routed = CounterMetricFamily(
        "gezel_replica_routed",
        "Requests of a replicated model that ran on each member.",
        labels=["model", "member"],
    )
    moved = CounterMetricFamily(
        "gezel_replica_sessions_moved",
        "Chats sent to another member than the one holding their KV (they re-prefill).",
        labels=["model"],
    )
    hits = CounterMetricFamily(
        "gezel_replica_prefix_hits",
        "Requests sent to a member because it held the longest prefix of their owner's KV.",
        labels=["model", "member"],
    )
    misses = CounterMetricFamily(
        "gezel_replica_prefix_misses",
        "Requests with a prefix sent to a member while no member held any of it.",
        labels=["model", "member"],
    )
    shed = CounterMetricFamily(
        "gezel_replica_prefix_shed",
        "Requests not sent to the member holding their prefix: its load was over "
        "[scheduler] prefix_load_bound.",
        labels=["model", "member"],
    )
    blocks = CounterMetricFamily(
        "gezel_replica_prefix_blocks",
        "Prefix blocks the member held of the requests sent to it for a prefix hit.",
        labels=["model", "member"],
    )
    for model, replica_set in replicas.items():
        router = replica_set.router
        for member, n in router.routed.items():
            routed.add_metric([model, member], float(n))
        moved.add_metric([model], float(router.moved))
        for member, counts in router.prefix.items():
            labels = [model, member]
            hits.add_metric(labels, float(counts.hits))
            misses.add_metric(labels, float(counts.misses))
            shed.add_metric(labels, float(counts.shed))
            blocks.add_metric(labels, float(counts.blocks))
    yield from (routed, moved, hits, misses, shed, blocks)


def _engine_families(engines: Sequence[ModelStats]) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "gezel_engine_state",
        "1 for the engine's current state, 0 for the others.",
        labels=["model", "state"],
    )
    busy = GaugeMetricFamily(
        "gezel_engine_busy", "Requests in flight on the engine.", labels=["model"]
    )
    starts = CounterMetricFamily("gezel_engine_starts", "Engine process starts.", labels=["model"])
    crashes = CounterMetricFamily(
        "gezel_engine_crashes",
        "Engine failures (exits, failed starts, dead health checks).",
        labels=["model"],
    )
    kv_gauges = {
        key: GaugeMetricFamily(f"gezel_kv_{name}", doc, labels=["model"])
        for key, name, doc in _KV_GAUGES
    }
    enabled = GaugeMetricFamily(
        "gezel_kv_parking_enabled",
        "1 while the model parks KV, 0 once restores proved not to take.",
        labels=["model"],
    )
    kv_counters = {
        key: CounterMetricFamily(f"gezel_kv_{name}", doc, labels=["model"])
        for key, name, doc in _KV_COUNTERS
    }
    for stats in engines:
        engine = stats.engine
        model = engine.model or engine.key
        if not model:
            continue
        for s in ENGINE_STATES:
            state.add_metric([model, s], 1.0 if engine.state == s else 0.0)
        busy.add_metric([model], float(engine.busy))
        starts.add_metric([model], float(engine.starts))
        crashes.add_metric([model], float(engine.crashes))
        kv = stats.kv_parking
        if kv is None:
            continue
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            *kv_gauges.items(),
            *kv_counters.items(),
        ]
        for key, family in families:
            family.add_metric([model], float(getattr(kv, key)))
        enabled.add_metric([model], 0.0 if kv.disabled else 1.0)
    parked, size = kv_gauges["parked"], kv_gauges["bytes"]
    yield from (state, busy, starts, crashes, parked, size, enabled, *kv_counters.values())


_KV_GAUGES = (
    ("parked", "parked_sessions", "Sessions with KV parked on disk."),
    ("bytes", "parked_bytes", "Bytes of parked KV files."),
)
"""(field of :class:`KvParkingStats`, series name, help) of the parking gauges."""
_KV_COUNTERS = (
    ("hits", "restore_hits", "Restores the next completion confirmed (it reused the tokens)."),
    ("misses", "misses", "Keyed jobs whose session was neither in its slot nor parked."),
    ("ineffective", "restores_ineffective", "Restores that did not take."),
    ("dropped_incompatible", "dropped_incompatible", "Parked files dropped as incompatible."),
    ("evicted", "evicted", "Parked files evicted by the byte budget."),
    ("saves", "saves", "KV saves."),
    ("save_failures", "save_failures", "KV saves that failed (logged with their reason)."),
    ("save_cancelled", "saves_cancelled", "KV saves cut short by a cancellation (no failure)."),
    ("restores", "restores", "KV restores the engine acknowledged in full."),
    ("restore_failures", "restore_failures", "KV restores the engine did not answer in time."),
    ("restore_cancelled", "restores_cancelled", "KV restores cut short by a cancellation."),
)


def _gpu_families(gpu: DeviceHealth) -> Iterator[Metric]:
    if not gpu.readings:
        return
    labels = ["gpu", "name"]
    temp = GaugeMetricFamily("gezel_gpu_temperature_celsius", "GPU temperature.", labels=labels)
    used = GaugeMetricFamily("gezel_gpu_memory_used_bytes", "GPU memory in use.", labels=labels)
    total = GaugeMetricFamily("gezel_gpu_memory_total_bytes", "GPU memory in total.", labels=labels)
    util = GaugeMetricFamily("gezel_gpu_utilization_percent", "GPU utilization.", labels=labels)
    for r in gpu.readings:
        lv = [str(r.index), r.name]
        for fam, value in (
            (temp, r.temperature_c),
            (used, r.memory_used_bytes),
            (total, r.memory_total_bytes),
            (util, r.utilization_pct),
        ):
            v = _num(value)
            if v is not None:
                fam.add_metric(lv, v)
    yield from (temp, used, total, util)


CALIBRATION_RESULTS = ("passed", "failed", "not_run")


def _calibration_families(engines: Sequence[ModelStats]) -> Iterator[Metric]:
    """Each model's calibration state (as ``/api/status`` shows it): the verdict in
    ``status``, the probe's figures under ``result``."""
    entries = [(stats.engine.model, stats.calibration) for stats in engines if stats.engine.model]
    if not entries:
        return
    result = GaugeMetricFamily(
        "gezel_calibration_result",
        "1 for the model's calibration verdict (passed, failed, not_run), 0 for the others.",
        labels=["model", "result"],
    )
    prompts = GaugeMetricFamily(
        "gezel_calibration_prompts", "Prompts the last calibration tried.", labels=["model"]
    )
    distinct = GaugeMetricFamily(
        "gezel_calibration_distinct_answers",
        "Distinct answers among identical co-batched prompts (1 is clean).",
        labels=["model"],
    )
    when = GaugeMetricFamily(
        "gezel_calibration_timestamp_seconds",
        "When the last calibration ran (Unix time).",
        labels=["model"],
    )
    restarts = GaugeMetricFamily(
        "gezel_calibration_restarts",
        "Engine restarts after a failed co-batch probe (the process might stay corrupt).",
        labels=["model"],
    )
    for model, entry in entries:
        # A model's calibration state names its verdict in "status" and keeps the
        # probe's figures in "result"; a bare result names it in "verdict".
        inner = entry.get("result")
        c: Mapping[str, Any] = {**inner, **entry} if isinstance(inner, Mapping) else entry
        verdict = next(
            (
                v
                for v in (c.get("status"), c.get("verdict"), c.get("state"), c.get("result"))
                if isinstance(v, str) and v in CALIBRATION_RESULTS
            ),
            None,
        )
        if isinstance(c.get("passed"), bool) and verdict is None:
            verdict = "passed" if c["passed"] else "failed"
        verdict = str(verdict or "not_run")
        count = _num(c.get("restarts_after_failure"))
        if count is not None:
            restarts.add_metric([model], count)
        for r in CALIBRATION_RESULTS:
            result.add_metric([model, r], 1.0 if verdict == r else 0.0)
        for fam, keys in (
            (prompts, ("prompts", "prompts_tried")),
            (distinct, ("distinct_answers", "distinct")),
            (when, ("finished_at", "at", "when", "ran_at")),
        ):
            for key in keys:
                v = _num(c.get(key))
                if v is not None:
                    fam.add_metric([model], v)
                    break
    yield from (result, prompts, distinct, when, restarts)
