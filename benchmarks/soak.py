"""Soak: replay a trace against a real host for N minutes; report what leaks.

    python -m benchmarks.soak [--minutes 10] [--trace SPEC] [--concurrency 8]
                              [--kill-every SECONDS] [--out benchmarks/results/soak.json]

Runs ``gezel-trio serve`` as its own process (the tiny demo model, generated
here) and replays the trace over and over until the time is up: a synthetic
agentic trace by default (sessions whose prompts grow turn by turn), or any
trace spec ``gezel_trio.bench.traces.open_trace_spec`` reads. Every few seconds
it samples the host process: resident memory (VmRSS), open file descriptors,
and the engines' starts and crashes from ``/api/status``. ``--kill-every``
SIGKILLs the engine on a period (a fault soak: requests in flight then may
fail, the rest must not).

Reports lost requests (failed, or never answered), RSS growth, leaked file
descriptors and restarts; prints them and writes a JSON file. Exits 1 when a
request was lost without a fault to explain it, when the descriptors grew by
more than ``--fd-slack``, or when RSS grew by more than ``--rss-slack-mb``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from gezel_trio.bench.replay import ReplayConfig, run_replay
from gezel_trio.bench.traces import Session, Trace, Turn, open_trace_spec

RESULTS = Path(__file__).resolve().parent / "results"


def synthetic_trace(
    *, sessions: int = 8, turns: int = 6, block: int = 16, output: int = 8, think: float = 0.05
) -> Trace:
    """An agentic shape: each session's prompt grows by one block a turn (its own prefix)."""
    out: list[Session] = []
    next_block = 1
    for s in range(sessions):
        blocks: list[int] = []
        sturns: list[Turn] = []
        for t in range(turns):
            blocks.extend(range(next_block, next_block + 2 if t == 0 else next_block + 1))
            next_block = blocks[-1] + 1
            sturns.append(
                Turn(
                    session=f"soak-{s}",
                    index=t,
                    t=s * 0.1 + t * think,
                    think_time=think,
                    blocks=tuple(blocks),
                    prompt_tokens=len(blocks) * block,
                    output_tokens=output,
                )
            )
        out.append(Session(id=f"soak-{s}", turns=tuple(sturns)))
    return Trace(block_size=block, source="synthetic soak", sessions=tuple(out))


def model_vocab(model: Path) -> int:
    """The model's vocabulary size (token ids the trace may use are below it)."""
    from gezel_trio.engine.gguf_meta import read_gguf_info

    size = read_gguf_info(model).vocab_size
    if size is None:
        raise SystemExit(f"{model}: no vocabulary size in its metadata")
    return size


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sample:
    t: float
    rss: int
    fds: int
    starts: int
    crashes: int


@dataclass
class SoakReport:
    minutes: float
    passes: int = 0
    requests: int = 0
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    kills: int = 0
    samples: list[Sample] = field(default_factory=list)

    @property
    def rss_growth(self) -> int:
        """Last sample minus the first (after warm-up), in bytes."""
        return self.samples[-1].rss - self.samples[0].rss if self.samples else 0

    @property
    def fd_growth(self) -> int:
        return self.samples[-1].fds - self.samples[0].fds if self.samples else 0

    @property
    def restarts(self) -> int:
        return max(0, self.samples[-1].starts - 1) if self.samples else 0

    @property
    def crashes(self) -> int:
        return self.samples[-1].crashes if self.samples else 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            rss_growth_bytes=self.rss_growth,
            fd_growth=self.fd_growth,
            restarts=self.restarts,
            crashes=self.crashes,
            rss_start_bytes=self.samples[0].rss if self.samples else None,
            rss_max_bytes=max((s.rss for s in self.samples), default=None),
        )
        return d

    def summary(self) -> str:
        mb = 1024 * 1024
        first = self.samples[0] if self.samples else None
        last = self.samples[-1] if self.samples else None
        return (
            f"soak {self.minutes:g} min: {self.passes} passes, {self.requests} requests, "
            f"{self.lost} lost, {self.kills} engine kills, {self.restarts} restarts "
            f"({self.crashes} crashes); RSS {first.rss / mb if first else 0:.1f} -> "
            f"{last.rss / mb if last else 0:.1f} MiB ({self.rss_growth / mb:+.1f}); "
            f"fds {first.fds if first else 0} -> {last.fds if last else 0} ({self.fd_growth:+d})"
        )


async def _engine_counts(client: httpx.AsyncClient) -> tuple[int, int, int | None]:
    status = (await client.get("/api/status")).json()
    starts = sum(int(e.get("starts") or 0) for e in status["engines"])
    crashes = sum(int(e.get("crashes") or 0) for e in status["engines"])
    pids = [e.get("pid") for e in status["engines"] if e.get("pid")]
    return starts, crashes, pids[0] if pids else None


async def soak(
    *,
    base_url: str,
    host_pid: int,
    trace: Trace,
    minutes: float,
    concurrency: int = 8,
    sample_every: float = 5.0,
    kill_every: float | None = None,
    api: str = "llama",
    vocab_hi: int | None = None,
) -> SoakReport:
    """Replay ``trace`` against ``base_url`` until ``minutes`` have passed; sample the host."""
    report = SoakReport(minutes=minutes)
    deadline = trio.current_time() + minutes * 60
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:

        async def sample() -> None:
            starts, crashes, _ = await _engine_counts(client)
            report.samples.append(
                Sample(time.time(), _rss(host_pid), _fds(host_pid), starts, crashes)
            )

        async def sampler() -> None:
            while True:
                await trio.sleep(sample_every)
                await sample()

        async def killer(period: float) -> None:
            while True:
                await trio.sleep(period)
                _, _, pid = await _engine_counts(client)
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        report.kills += 1
                    except ProcessLookupError:
                        pass

        first = True
        async with trio.open_nursery() as nursery:
            while trio.current_time() < deadline:
                config = ReplayConfig(
                    base_url=base_url,
                    api=api,  # type: ignore[arg-type]
                    concurrency=concurrency,
                    warmup=first,
                    label=f"pass-{report.passes}",
                    request_timeout=120.0,
                    time_scale=1.0,
                    vocab_hi=vocab_hi,
                )
                result = await run_replay(trace, config, client=client, progress_stream=None)
                if first:
                    # the baseline is taken after one warm pass: pools, caches, the engine
                    await sample()
                    nursery.start_soon(sampler)
                    if kill_every:
                        nursery.start_soon(killer, kill_every)
                    first = False
                report.passes += 1
                report.requests += len(result.records)
                expected = trace.n_requests
                missing = expected - len(result.records)
                failed = [r for r in result.records if not r.ok]
                report.lost += missing + len(failed)
                for r in failed[: max(0, 10 - len(report.lost_examples))]:
                    report.lost_examples.append(f"{r.session}#{r.turn}: {r.error}")
            nursery.cancel_scope.cancel()
        await sample()
    return report


def main() -> None:
    from gezel_trio.engine.demo_model import write_demo_model

    from ._harness import host_process

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument(
        "--trace", default=None, help="a trace spec (default: a synthetic agentic trace)"
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--kill-every", type=float, default=None, help="SIGKILL the engine every N s")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--fd-slack", type=int, default=8)
    p.add_argument("--rss-slack-mb", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args()

    trace = open_trace_spec(args.trace) if args.trace else synthetic_trace()
    model = write_demo_model(
        Path(os.environ.get("TMPDIR", "/tmp")) / "gezel-soak-tiny.gguf", size="tiny"
    )
    models = [{"id": "tiny", "path": str(model), "parallel": args.parallel, "ctx_per_slot": 2048}]
    with host_process(models) as (base, proc):
        vocab = model_vocab(model)
        report = trio.run(
            lambda: soak(
                base_url=base,
                host_pid=proc.pid,
                trace=trace,
                minutes=args.minutes,
                concurrency=args.concurrency,
                sample_every=args.sample_every,
                kill_every=args.kill_every,
                vocab_hi=vocab,
            )
        )
    print(report.summary())
    for line in report.lost_examples:
        print("  lost:", line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    print(f"wrote {args.out}")
    bad = (
        (report.lost > 0 and not report.kills)
        or report.fd_growth > args.fd_slack
        or report.rss_growth > args.rss_slack_mb * 1024 * 1024
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
