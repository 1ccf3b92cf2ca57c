"""The report's PNGs (matplotlib, Agg): utilisation per node, throughput, loss, step times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtrain.monitor.head.metrics_db import MetricsDB


def _minutes(ts: list[float], t0: float) -> list[float]:
    return [(t - t0) / 60.0 for t in ts]


def write_plots(store: MetricsDB, out: Path) -> dict[str, str]:
    """Write the plots that have data; returns {title: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = store.time_range()
    if span is None:
        return {}
    t0 = span[0]
    nodes, gpus, ranks = store.node_series(), store.gpu_series(), store.rank_series()
    written: dict[str, str] = {}

    def save(fig: Any, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written[title] = name

    panels = 2 if gpus else 1
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3 * panels), sharex=True, squeeze=False)
    for node, s in sorted(nodes.items()):
        axes[0][0].plot(_minutes(s["t"], t0), [100 * (v or 0) for v in s["cpu"]], label=f"{node} CPU", lw=1)
    axes[0][0].set_ylabel("CPU %")
    axes[0][0].set_ylim(0, 105)
    if gpus:
        for (node, gpu), s in sorted(gpus.items()):
            axes[1][0].plot(_minutes(s["t"], t0), [100 * (v or 0) for v in s["util"]], label=f"{node} GPU {gpu}", lw=1)
        axes[1][0].set_ylabel("GPU %")
        axes[1][0].set_ylim(0, 105)
    for ax in axes[:, 0]:
        ax.legend(loc="upper right", fontsize="small", ncol=4)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("minutes")
    save(fig, "utilization.png", "Utilisation per node")

    if ranks:
        by_t: dict[float, float] = {}
        for s in ranks.values():
            for t, v in zip(s["t"], s["samples_per_s"]):
                if v is not None:
                    by_t[t] = by_t.get(t, 0.0) + v
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        ts = sorted(by_t)
        ax1.plot(_minutes(ts, t0), [by_t[t] for t in ts], lw=1)
        ax1.set_ylabel("samples/s (all ranks)")
        for (node, rank), s in sorted(ranks.items(), key=lambda kv: kv[0][1]):
            pts = [(t, v) for t, v, k in zip(s["t"], s["step_time"], s["steps"]) if k]
            ax2.plot(_minutes([p[0] for p in pts], t0), [p[1] for p in pts], lw=1, label=f"rank {rank} ({node})")
        ax2.set_ylabel("step time s")
        ax2.set_xlabel("minutes")
        ax2.legend(loc="upper right", fontsize="small", ncol=4)
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
        save(fig, "throughput.png", "Throughput and step time")

        fig, ax = plt.subplots(figsize=(9, 3))
        for (node, rank), s in sorted(ranks.items(), key=lambda kv: kv[0][1]):
            pts = [(t, v) for t, v in zip(s["t"], s["loss"]) if v is not None]
            if pts:
                ax.plot(_minutes([p[0] for p in pts], t0), [p[1] for p in pts], lw=1, label=f"rank {rank}")
        ax.set_ylabel("training loss")
        ax.set_xlabel("minutes")
        ax.legend(loc="upper right", fontsize="small", ncol=4)
        ax.grid(alpha=0.3)
        save(fig, "loss.png", "Loss")
    return written
