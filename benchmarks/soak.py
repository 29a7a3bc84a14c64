"""Memory soak: drive a running server with a mixed load for a long time and check that the
engine's and the server's memory stay flat and that the gauges return to 0 once it drains.

    .venv/bin/python benchmarks/soak.py --server-pid PID [--url http://127.0.0.1:8000]
        [--concurrency 8] [--duration 1800] [--warmup 300] [--sample-interval 30] [--out soak.json]
        [--hostile] [--extra-pid PID ...] [--stop-pid PID --stop-every 180 --stop-for 30]

The load mixes four kinds of request, round robin over the workers: streaming chat
completions, non-streaming completions with n=2, structured output (response_format
json_schema) and streams the client aborts after a few chunks (it closes the connection).
Prompts differ from request to request so the prefix cache keeps taking new blocks.

With --hostile a fifth kind joins them: specs a grammar compiler must refuse, each of which
counts as answered only as a 400 with the expected reason: a schema of 5,000 optional
properties (refused by --max-schema-cost), a regex that admits nothing, and now and then a
grammar whose compile runs past the server's deadline (the server needs --max-schema-bytes
1000000 for it), under a new name (killed at the deadline) or under one already refused
(refused at once). With --stop-pid the soak also SIGSTOPs that process (a prefiller's
EngineCore behind `tokenbus proxy`) for --stop-for seconds every --stop-every seconds; requests
sent meanwhile must still be answered. --record DIR writes the run's record (topic soak).

Memory is sampled every --sample-interval seconds from /proc: the server (--server-pid) and the
engine (its child processes, summed; multiprocessing's resource tracker is not an engine, and the
front door's grammar-check processes are reported apart: they are killed and replaced), and so
for every --extra-pid server (a prefiller), added to the first's. On CPU the KV pool is
calloc'd: its pages become resident only when a block is first written, so engine RSS rises by
up to the pool's size as the LRU free queue cycles through every block. That growth is bounded
and expected; the verdict therefore judges the engine's RSS *net of the KV pool's resident
pages* (the pool's per-layer tensors are found in /proc/PID/smaps as a run of equally sized
anonymous mappings), and the raw RSS is reported beside it.

Exit status 1 if any request failed, if the engine's (net) or the server's RSS grew more than
--max-growth (5%) from the first sample after --warmup to the last, or if the gauges
tokenbus:num_requests_running / _waiting / kv_cache_usage_perc are not 0 after draining.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil

from soak_requests import REQUESTS, make_prompt

KINDS = ("chat_stream", "completion_n2", "structured", "abort")
HOSTILE_KINDS = (*KINDS, "hostile")
GAUGES = (
    "tokenbus:num_requests_running",
    "tokenbus:num_requests_waiting",
    "tokenbus:kv_cache_usage_perc",
)
MIB = 2**20
REQUEST_TIMEOUT_S = 300  # generous: 8 streams share 2 cores; a hang still shows up as an error


# ---------------------------------------------------------------------------- data
@dataclass
class Options:
    url: str
    server_pid: int
    concurrency: int
    duration: float
    warmup: float
    sample_interval: float
    drain_timeout: float
    max_growth: float
    seed: int
    out: Path | None
    hostile: bool = False
    extra_pids: tuple[int, ...] = ()
    stop_pid: int | None = None
    stop_every: float = 180.0
    stop_for: float = 30.0
    record: str | None = None  # a results dir (src/tokenbus/bench/record.py)
    variant: str = ""
    command: str | None = None  # the record's command (soak.sh's), else this process's

    @property
    def kinds(self) -> tuple[str, ...]:
        return HOSTILE_KINDS if self.hostile else KINDS


@dataclass
class Tally:
    """Requests finished and failed so far, by kind (failures also by cause)."""

    requests: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_causes: Counter = field(default_factory=Counter)
    last_error: str = ""

    def fail(self, kind: str, cause: str) -> None:
        self.errors[kind] += 1
        self.error_causes[cause.split(":")[0][:60]] += 1
        self.last_error = f"{kind}: {cause}"[:300]


@dataclass
class Sample:
    t: float  # seconds since the load started
    engine_rss_mib: float
    engine_kv_rss_mib: float  # resident pages of the KV pool (part of engine_rss_mib)
    server_rss_mib: float
    checkers: int  # the front door's grammar-check processes (and their forkserver)
    checkers_rss_mib: float
    requests: dict[str, int]  # finished so far, by kind
    errors: dict[str, int]  # failed so far, by kind

    @property
    def engine_net_mib(self) -> float:
        return self.engine_rss_mib - self.engine_kv_rss_mib


@dataclass
class Growth:
    name: str
    first: float  # MiB in the first sample after warm-up
    last: float
    limit: float

    @property
    def relative(self) -> float:
        return (self.last - self.first) / self.first if self.first else 0.0

    @property
    def ok(self) -> bool:
        return self.relative <= self.limit


# ---------------------------------------------------------------------------- memory
def engine_processes(server: psutil.Process) -> list[psutil.Process]:
    """The server's descendants that run an engine: not multiprocessing's resource tracker,
    not the grammar-check processes (checker_processes)."""
    return [p for p, role in descendants(server) if role == "engine"]


def checker_processes(server: psutil.Process) -> list[psutil.Process]:
    """The front door's grammar-check processes and the forkserver they are forked from."""
    return [p for p, role in descendants(server) if role == "checker"]


def descendants(server: psutil.Process) -> list[tuple[psutil.Process, str]]:
    found = []
    for child in server.children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "resource_tracker" in cmdline:
            continue
        # Forked from the forkserver, the checks carry its command line.
        found.append((child, "checker" if "forkserver" in cmdline else "engine"))
    return found


def kv_pool_rss_bytes(pid: int) -> int:
    """Resident bytes of the KV pool: the largest group (>= 8) of equally sized anonymous
    mappings of >= 16 MiB, one per layer. 0 if there is no such group (e.g. a GPU pool)."""
    groups: dict[int, int] = {}  # mapping size (KiB) → resident KiB summed
    counts: Counter = Counter()
    size_kib, anonymous = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                anonymous = len(fields) < 6  # no path: anonymous
            elif line.startswith("Size:"):
                size_kib = int(line.split()[1])
            elif line.startswith("Rss:") and anonymous and size_kib >= 16 * 1024:
                groups[size_kib] = groups.get(size_kib, 0) + int(line.split()[1])
                counts[size_kib] += 1
    if not counts:
        return 0
    size, count = counts.most_common(1)[0]
    return groups[size] * 1024 if count >= 8 else 0


def take_sample(servers: list[psutil.Process], t: float, tally: Tally) -> Sample:
    engine_rss = kv_rss = 0
    for proc in (engine for server in servers for engine in engine_processes(server)):
        try:
            engine_rss += proc.memory_info().rss
            kv_rss += kv_pool_rss_bytes(proc.pid)
        except (psutil.NoSuchProcess, FileNotFoundError):
            pass
    checkers = [p for server in servers for p in checker_processes(server)]
    checkers_rss = 0
    for proc in checkers:
        try:
            checkers_rss += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return Sample(
        t=round(t, 1),
        engine_rss_mib=engine_rss / MIB,
        engine_kv_rss_mib=kv_rss / MIB,
        server_rss_mib=sum(server.memory_info().rss for server in servers) / MIB,
        checkers=len(checkers),
        checkers_rss_mib=checkers_rss / MIB,
        requests=dict(tally.requests),
        errors=dict(tally.errors),
    )


# ---------------------------------------------------------------------------- requests
async def worker(
    index: int,
    session: aiohttp.ClientSession,
    opts: Options,
    deadline: float,
    tally: Tally,
    serials: itertools.count,
) -> None:
    """Send requests back to back until the deadline; worker i starts at kind i (mod the
    number of kinds) so every kind is in flight at any moment."""
    rng = random.Random(opts.seed * 1000 + index)
    kinds = opts.kinds
    for kind in itertools.islice(itertools.cycle(kinds), index % len(kinds), None):
        if time.monotonic() >= deadline:
            return
        try:
            await asyncio.wait_for(
                REQUESTS[kind](session, opts.url, make_prompt(rng, next(serials))),
                REQUEST_TIMEOUT_S,
            )
            tally.requests[kind] += 1
        except asyncio.TimeoutError:
            tally.fail(kind, "timeout")
        except Exception as exc:  # every failure counts; the soak goes on
            tally.fail(kind, f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------- gauges
def parse_gauges(metrics_text: str) -> dict[str, float]:
    """Each gauge summed over its series (one per data-parallel engine)."""
    values = dict.fromkeys(GAUGES, 0.0)
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


async def drained_gauges(session: aiohttp.ClientSession, opts: Options) -> dict[str, float]:
    """The gauges once they read 0, or their last values after --drain-timeout: aborts reach
    the engine asynchronously, so the first read after the load may still count them."""
    deadline = time.monotonic() + opts.drain_timeout
    while True:
        async with session.get(f"{opts.url}/metrics") as resp:
            gauges = parse_gauges(await resp.text())
        if not any(gauges.values()) or time.monotonic() >= deadline:
            return gauges
        await asyncio.sleep(1.0)


# ---------------------------------------------------------------------------- the run
async def stop_and_resume(opts: Options, start: float, stop: asyncio.Event) -> None:
    """SIGSTOP opts.stop_pid for stop_for seconds every stop_every seconds, until `stop`."""
    assert opts.stop_pid is not None
    while True:
        try:
            await asyncio.wait_for(stop.wait(), opts.stop_every)
            return
        except asyncio.TimeoutError:
            pass
        os.kill(opts.stop_pid, signal.SIGSTOP)
        print(f"{time.monotonic() - start:7.0f} stopped pid {opts.stop_pid}", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), opts.stop_for)
        except asyncio.TimeoutError:
            pass
        finally:
            os.kill(opts.stop_pid, signal.SIGCONT)
            print(f"{time.monotonic() - start:7.0f} resumed pid {opts.stop_pid}", flush=True)
        if stop.is_set():
            return


async def sample_every(
    opts: Options,
    server: list[psutil.Process],
    start: float,
    stop: asyncio.Event,
    tally: Tally,
    samples: list[Sample],
) -> None:
    while True:
        samples.append(take_sample(server, time.monotonic() - start, tally))
        print_sample(samples[-1])
        try:
            await asyncio.wait_for(stop.wait(), opts.sample_interval)
            return
        except asyncio.TimeoutError:
            pass


async def run(opts: Options) -> tuple[list[Sample], Tally, dict[str, float]]:
    server = [psutil.Process(pid) for pid in (opts.server_pid, *opts.extra_pids)]
    tally, samples, stop = Tally(), [], asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=opts.concurrency + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic()
        print_header()
        sampler = asyncio.create_task(sample_every(opts, server, start, stop, tally, samples))
        load_done = asyncio.Event()
        stopper = (
            asyncio.create_task(stop_and_resume(opts, start, load_done))
            if opts.stop_pid is not None
            else None
        )
        serials = itertools.count()
        await asyncio.gather(
            *(
                worker(i, session, opts, start + opts.duration, tally, serials)
                for i in range(opts.concurrency)
            )
        )
        load_done.set()
        if stopper is not None:
            await stopper  # resumed before the drain: its gauges must reach 0 too
        gauges = await drained_gauges(session, opts)
        stop.set()
        await sampler
        # The last sample is taken after draining, so it shows the idle engine.
        samples.append(take_sample(server, time.monotonic() - start, tally))
        print_sample(samples[-1])
    return samples, tally, gauges


def growths(samples: list[Sample], opts: Options) -> list[Growth]:
    after = [s for s in samples if s.t >= opts.warmup]
    first = after[0] if len(after) >= 2 else samples[0]  # run too short for warm-up: from the start
    last = samples[-1]
    return [
        Growth(
            "engine RSS net of KV pool", first.engine_net_mib, last.engine_net_mib, opts.max_growth
        ),
        Growth("engine RSS (raw)", first.engine_rss_mib, last.engine_rss_mib, float("inf")),
        Growth("server RSS", first.server_rss_mib, last.server_rss_mib, opts.max_growth),
    ]


# ---------------------------------------------------------------------------- output
def print_header() -> None:
    print(
        f"{'t (s)':>7} {'engine MiB':>11} {'KV pool':>8} {'net':>8} {'server MiB':>11} "
        f"{'checkers (MiB)':>15} {'requests':>9} {'errors':>7}",
        flush=True,
    )


def print_sample(s: Sample) -> None:
    by_kind = " ".join(f"{k}={n}" for k, n in sorted(s.requests.items()))
    print(
        f"{s.t:7.0f} {s.engine_rss_mib:11.1f} {s.engine_kv_rss_mib:8.1f} {s.engine_net_mib:8.1f} "
        f"{s.server_rss_mib:11.1f} {s.checkers:3d} ({s.checkers_rss_mib:7.1f}) "
        f"{sum(s.requests.values()):9d} "
        f"{sum(s.errors.values()):7d}  {by_kind}",
        flush=True,
    )


def report(samples: list[Sample], tally: Tally, gauges: dict[str, float], opts: Options) -> bool:
    checks = growths(samples, opts)
    errors = sum(tally.errors.values())
    gauges_ok = not any(gauges.values())
    print()
    for g in checks:
        limit = (
            ""
            if g.limit == float("inf")
            else f"  (limit +{g.limit:.0%}: {'ok' if g.ok else 'GREW'})"
        )
        print(f"{g.name:>26}: {g.first:8.1f} -> {g.last:8.1f} MiB  {g.relative:+.1%}{limit}")
    print(f"{'requests':>26}: {dict(tally.requests)}")
    print(f"{'errors':>26}: {errors} {dict(tally.errors) or ''} {dict(tally.error_causes) or ''}")
    if tally.last_error:
        print(f"{'last error':>26}: {tally.last_error}")
    print(f"{'gauges after drain':>26}: {gauges} ({'ok' if gauges_ok else 'NOT 0'})")
    ok = errors == 0 and gauges_ok and all(g.ok for g in checks)
    print(f"{'verdict':>26}: {'PASS' if ok else 'FAIL'}")
    if opts.out is not None:
        result = {
            "options": {**asdict(opts), "out": str(opts.out)},
            "samples": [{**asdict(s), "engine_net_mib": s.engine_net_mib} for s in samples],
            "growth": [{**asdict(g), "relative": g.relative, "ok": g.ok} for g in checks],
            "requests": dict(tally.requests),
            "errors": dict(tally.errors),
            "error_causes": dict(tally.error_causes),
            "last_error": tally.last_error,
            "gauges": gauges,
            "pass": ok,
        }
        opts.out.write_text(json.dumps(result, indent=1, default=str))
    if opts.record:
        write_record(samples, tally, checks, opts)
    return ok


def write_record(samples: list[Sample], tally: Tally, checks: list[Growth], opts: Options) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from tokenbus.bench.record import make_record, this_command
    from tokenbus.bench.record import write_record as write

    net, _, server = checks
    row = {
        "requests": sum(tally.requests.values()),
        "errors": sum(tally.errors.values()),
        f"engine RSS net of KV at {opts.warmup:g} s": round(net.first),
        f"at {opts.duration:g} s": round(net.last),
        "growth": round(100 * net.relative, 1),
        "server RSS": round(server.last),
        "server growth": round(100 * server.relative, 1),
    }
    if opts.hostile:
        row["hostile 400s"] = tally.requests.get("hostile", 0)
    if opts.stop_pid is not None:
        row["prefiller stops"] = f"{opts.stop_for:g} s every {opts.stop_every:g} s"
    units = {name: "MiB" for name in row if "RSS" in name or name.startswith("at ")}
    units.update({"growth": "%", "server growth": "%"})
    command = opts.command or this_command()
    entry = make_record("soak", command, {"": row}, units=units, variant=opts.variant)
    write(opts.record, entry)


def parse_args() -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--server-pid", type=int, required=True, help="the `tokenbus serve` process")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=1800, help="seconds of load")
    p.add_argument(
        "--warmup",
        type=float,
        default=300,
        help="growth is measured from the first sample after this",
    )
    p.add_argument("--sample-interval", type=float, default=30)
    p.add_argument(
        "--drain-timeout", type=float, default=30, help="seconds for the gauges to reach 0"
    )
    p.add_argument(
        "--max-growth", type=float, default=0.05, help="allowed relative RSS growth after warm-up"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--hostile", action="store_true", help="add specs the server must refuse")
    p.add_argument(
        "--extra-pid", type=int, nargs="*", default=[], help="more servers whose memory counts"
    )
    p.add_argument("--stop-pid", type=int, default=None, help="a process to SIGSTOP now and then")
    p.add_argument("--stop-every", type=float, default=180.0)
    p.add_argument("--stop-for", type=float, default=30.0)
    p.add_argument("--record", default=None, metavar="DIR", help="write a run record there")
    p.add_argument("--variant", default="", help="the record's setting (e.g. the serve flags)")
    p.add_argument("--command", default=None, help="the record's command (default: this one)")
    a = p.parse_args()
    return Options(
        url=a.url.rstrip("/"),
        server_pid=a.server_pid,
        concurrency=a.concurrency,
        duration=a.duration,
        warmup=a.warmup,
        sample_interval=a.sample_interval,
        drain_timeout=a.drain_timeout,
        max_growth=a.max_growth,
        seed=a.seed,
        out=a.out,
        hostile=a.hostile,
        extra_pids=tuple(a.extra_pid),
        stop_pid=a.stop_pid,
        stop_every=a.stop_every,
        stop_for=a.stop_for,
        record=a.record,
        variant=a.variant,
        command=a.command,
    )


def main() -> int:
    opts = parse_args()
    samples, tally, gauges = asyncio.run(run(opts))
    return 0 if report(samples, tally, gauges, opts) else 1


if __name__ == "__main__":
    sys.exit(main())
