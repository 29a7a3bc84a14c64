"""Benchmark results and their table (L6)."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class BenchResult:
    name: str
    num_requests: int
    elapsed_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "machine": machine_description(),
        }


def machine_description() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, {threads} torch threads, torch {torch.__version__}"


def print_table(results: list[BenchResult]) -> None:
    base = results[0]
    header = (
        f"{'engine':<28}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}{'vs first':>10}"
        f"{'time s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r.total_tokens_per_s / base.total_tokens_per_s
        print(
            f"{r.name:<28}{r.requests_per_s:>9.2f}{r.output_tokens_per_s:>11.1f}"
            f"{r.total_tokens_per_s:>13.1f}{ratio:>9.2f}x{r.elapsed_s:>9.1f}"
        )
        for key, value in r.extra.items():
            print(f"    {key}: {value:.4g}" if isinstance(value, float) else f"    {key}: {value}")
    print(f"machine: {machine_description()}")
