"""Draw docs/benchmarks.png from a suite run's benchmarks.json (needs matplotlib,
the ``bench`` extra): one panel per figure, one bar per library."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = [
    ("drain_1", "Drain, 1 process (tasks/s)"),
    ("drain_2", "Drain, 2 processes (tasks/s)"),
    ("enqueue_single", "Enqueue, one at a time (tasks/s)"),
    ("latency_p50_ms", "Latency p50 (ms, lower is better)"),
    ("latency_p99_ms", "Latency p99 (ms, lower is better)"),
    ("commands_per_task", "Redis commands per task (lower is better)"),
]


def main(source: Path) -> None:
    data = json.loads(source.read_text())
    samples: dict[str, dict[str, list[float]]] = data["samples"]
    libraries = list(samples)
    figure, axes = plt.subplots(2, 3, figsize=(13, 7))
    for axis, (key, title) in zip(axes.flat, PANELS, strict=True):
        names = [lib for lib in libraries if samples[lib].get(key)]
        values = [statistics.median(samples[lib][key]) for lib in names]
        colours = ["#c0392b" if lib == "worqr" else "#7f8c8d" for lib in names]
        axis.bar(names, values, color=colours)
        axis.set_title(title, fontsize=10)
        if key.startswith("latency"):  # from under a millisecond to seconds
            axis.set_yscale("log")
        axis.tick_params(axis="x", labelsize=8)
    meta = data["meta"]
    figure.suptitle(f"worqr and peers, {meta['mode']} run {meta['date']} ({meta['machine']})")
    figure.tight_layout()
    figure.savefig(source.with_name("benchmarks.png"), dpi=80)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
