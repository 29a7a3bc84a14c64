"""How long a GGUF takes to load and how much memory the engine then holds, against the targets
peak RSS <= GGUF size + KV pool + 400 MiB and (an 8B Q4_K_M) load <= 15 s.

    .venv/bin/python benchmarks/gguf_load.py --model FILE [--cold] [--phases]
        [--max-model-len 4096] [--record benchmarks/results]

Load: the wall time of `LLM(FILE)` as a user starts it (the EngineCore in its own process, the
tokenizer loaded beside it), until the engine is ready. Peak RSS: the EngineCore process's
VmHWM after the load, and again after one 512-token prompt with 16 output tokens (activations,
touched KV blocks). The KV pool in the target is the pool's full size (its pages become
resident only as blocks fill). --cold first drops this file's pages from the page cache
(posix_fadvise DONTNEED: this file only), so the load reads the disk; otherwise what the page
cache holds of the file is recorded. --phases first loads the file once with the engine in
this process (a fresh interpreter: its imports count) and times each phase: GGUF header and
config, tokenizer, the weights' bytes read from the file and copied (and dequantized, for types
without kernels), their repack into tiles, the rest of building the model, the KV pool, and the
rest (imports, kernels, engine). The engine and tokenizer then run one after the other, not
side by side as in the measured load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenbus import LLM, SamplingParams
from tokenbus.bench.record import make_record, record_dir, this_command, write_record

MiB = 2**20
RSS_SLACK = 400 * MiB  # the target's allowance over the file and the KV pool
LOAD_TARGET_S = 15.0  # for an 8B Q4_K_M: the only file the load target names


def proc_status_bytes(pid: int, field: str) -> int:
    """A /proc/PID/status memory field (VmHWM: peak RSS, VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no {field}")


def engine_pid() -> int:
    """The EngineCore process: this process's child with the largest resident set."""
    children = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            children += [int(p) for p in (task / "children").read_text().split()]
    if not children:
        raise RuntimeError("no EngineCore child process found")
    return max(children, key=lambda pid: proc_status_bytes(pid, "VmRSS"))


def cached_fraction(path: Path) -> float | None:
    """How much of the file the page cache holds (util-linux fincore), None where unknown."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(out.split()[0]) / path.stat().st_size
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def evict(path: Path) -> None:
    """Drop this file's clean pages from the page cache (no other file's)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def kv_pool_bytes(llm: LLM) -> int:
    """The KV pool's full size: its blocks times a block's bytes in the resolved KV dtype."""
    from tokenbus.engine.setup import resolve_config
    from tokenbus.model.kv_quant import kv_storage_dtype
    from tokenbus.worker.kv_cache import bytes_per_block

    setup = llm.engine.setup
    config = resolve_config(setup.config, setup.source)
    dtype = kv_storage_dtype(config.cache.kv_cache_dtype)
    return llm.engine.client.num_kv_blocks * bytes_per_block(
        setup.arch, config.cache.block_size, dtype
    )


def prompt_512(llm: LLM) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(512)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)


def measure_load(args: argparse.Namespace, path: Path) -> dict:
    """Load as a user does (EngineCore in its own process): seconds and the engine's peak RSS."""
    if args.cold:
        evict(path)
    cached = cached_fraction(path)
    machine_load = os.getloadavg()[0]  # the machine is shared: how busy it was
    start = time.perf_counter()
    llm = LLM(str(path), max_model_len=args.max_model_len)
    load_s = time.perf_counter() - start
    pid = engine_pid()
    after_load = proc_status_bytes(pid, "VmHWM")
    prompt_512(llm)
    after_prompt = proc_status_bytes(pid, "VmHWM")
    kv = kv_pool_bytes(llm)
    llm.shutdown()
    return {
        "load_s": load_s,
        "after_load": after_load,
        "after_prompt": after_prompt,
        "kv": kv,
        "cached": cached,
        "machine_load": machine_load,
    }


class PhaseClock:
    """Seconds spent inside wrapped functions, by phase (patched in for one in-process load)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)

        return timed

    def wrap_iter(self, phase: str, fn: Callable) -> Callable:
        """For a generator function: the time spent producing each item."""

        def timed(*args, **kwargs) -> Iterator:
            items = iter(fn(*args, **kwargs))
            while True:
                start = time.perf_counter()
                try:
                    item = next(items)
                except StopIteration:
                    self.add(phase, time.perf_counter() - start)
                    return
                self.add(phase, time.perf_counter() - start)
                yield item

        return timed

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@contextlib.contextmanager
def patched(target: object, name: str, replacement: object) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        setattr(target, name, original)


# (phase, module path, attribute, generator?) in the order a load runs them; a phase that
# contains a later one (load_model contains the weights' reading and repack) reports its own
# time less theirs.
PHASES = (
    ("GGUF header, config", "tokenbus.engine.llm_engine", "create_engine_setup", False),
    ("tokenizer", "tokenbus.engine.setup", "create_tokenizer", False),
    ("device, threads", "tokenbus.worker.worker:Worker", "init_device", False),
    ("build the model (rest)", "tokenbus.worker.worker:Worker", "load_model", False),
    ("read and copy the weights", "tokenbus.worker.model_builder", "iter_weights", True),
    ("repack into tiles", "tokenbus.model.native:QuantKernels", "repack_tiles", False),
    ("KV pool", "tokenbus.worker.worker:Worker", "determine_num_kv_blocks", False),
    ("KV pool", "tokenbus.worker.worker:Worker", "initialize_kv_cache", False),
)
NESTED = {"build the model (rest)": ("read and copy the weights", "repack into tiles")}


def measure_phases(args: argparse.Namespace, path: Path) -> dict[str, float]:
    """One load with the engine in this process, each phase timed; 'other' is the rest."""
    import importlib

    clock = PhaseClock()
    if args.cold:
        evict(path)
    with contextlib.ExitStack() as stack:
        for phase, where, name, generator in PHASES:
            module, _, cls = where.partition(":")
            target = importlib.import_module(module)
            target = getattr(target, cls) if cls else target
            wrap = clock.wrap_iter if generator else clock.wrap
            stack.enter_context(patched(target, name, wrap(phase, getattr(target, name))))
        start = time.perf_counter()
        llm = LLM(str(path), max_model_len=args.max_model_len, multiprocess=False)
        total = time.perf_counter() - start
    llm.shutdown()
    del llm
    gc.collect()  # its weights freed before the measured load starts
    seconds = dict(clock.seconds)
    for outer, inner in NESTED.items():
        seconds[outer] = seconds.get(outer, 0.0) - sum(seconds.get(p, 0.0) for p in inner)
    seconds["other (imports, kernels, engine)"] = total - sum(seconds.values())
    return {"total": total, **seconds}


def load_record(args: argparse.Namespace, path: Path, load: dict, phases: dict | None) -> dict:
    size = path.stat().st_size
    target_rss = size + load["kv"] + RSS_SLACK
    rows: dict[str, dict] = {}
    eight_b_q4_k_m = "8b" in path.name.lower() and "q4_k_m" in path.name.lower()
    rows["load"] = {
        "measured": round(load["load_s"], 1),
        "load average": round(load["machine_load"], 2),
    }
    if eight_b_q4_k_m:
        rows["load"] |= {
            "target": LOAD_TARGET_S,
            "measured / target": round(load["load_s"] / LOAD_TARGET_S, 2),
        }
    for label, key in (
        ("peak RSS after load", "after_load"),
        ("peak RSS after a 512-token prompt", "after_prompt"),
    ):
        rows[label] = {
            "measured": round(load[key] / MiB),
            "target": round(target_rss / MiB),
            "measured / target": round(load[key] / target_rss, 2),
        }
    units = {label: "MiB" for label in rows if label.startswith("peak")}
    units |= {"load": "s", "measured / target": "×"}
    for phase, seconds in (phases or {}).items():
        rows[f"in-process load: {phase}"] = {"measured": round(seconds, 2)}
        units[f"in-process load: {phase}"] = "s"
    cache = "cold cache" if args.cold else f"{load['cached']:.0%} in page cache"
    if load["cached"] is None:
        cache = "cold cache" if args.cold else "page cache unknown"
    variant = (
        f"{path.name} ({size / 2**30:.2f} GiB, KV pool {load['kv'] / MiB:.0f} MiB, "
        f"{'cold' if args.cold else 'warm'})"
    )
    record = make_record("gguf_load", this_command(), rows, units=units, variant=variant)
    record["page_cache"] = cache
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, metavar="FILE")
    parser.add_argument("--cold", action="store_true", help="evict the file from the page cache")
    parser.add_argument("--phases", action="store_true", help="then time each phase in-process")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--record", default=None, metavar="DIR")
    args = parser.parse_args()
    path = args.model.expanduser().resolve()
    print(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB; load {os.getloadavg()[0]:.2f}")
    # Phases first, while this interpreter has imported nothing: its imports are counted too.
    phases = measure_phases(args, path) if args.phases else None
    load = measure_load(args, path)
    record = load_record(args, path, load, phases)
    print(f"page cache before the load: {record['page_cache']}")
    for label, cells in record["rows"].items():
        print(f"  {label}: {cells}")
    if record_dir(args.record):
        name = f"{record['date'][:10]}-{path.stem}{'-cold' if args.cold else ''}"
        write_record(record_dir(args.record), record, name=name)


if __name__ == "__main__":
    main()
