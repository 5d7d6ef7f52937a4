"""Figures for ``shoal bench`` and ``shoal report`` (matplotlib, written as PNG files)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` with a file-only backend, or a one-line error naming the package."""
    try:
        import matplotlib
    except ImportError:
        raise ShoalError("plots need the 'matplotlib' package "
                         "(pip install matplotlib, or shoal[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_figure(rows: Sequence[dict[str, Any]], path: Path, title: str = "",
                 dashed: str = "") -> None:
    """Throughput, scaling efficiency and communication fraction against workers.

    One line per (model, strategy, scaling, threads); the strategy labelled ``dashed`` (the
    hand-written DDP reference) dashed. Error bars span the repeats' minimum to maximum.
    """
    plt = require_matplotlib()
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        series[f"{r['model']} {r['strategy']} ({r['scaling']}, {r['threads_label']} thr)"].append(r)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=80)
    panels = (("samples_per_s", "samples/s (median)"), ("efficiency", "scaling efficiency"),
              ("comm_fraction", "communication fraction"))
    colors = {name: f"C{i % 10}" for i, name in enumerate(series)}
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, pts in series.items():
            pts = sorted((p for p in pts if p.get(key) is not None), key=lambda p: p["workers"])
            if not pts:
                continue
            xs = [p["workers"] for p in pts]
            ys = [p[key] for p in pts]
            style = "--" if pts[0]["strategy"] == dashed else "-"
            if key == "samples_per_s":
                lo = [y - p["samples_per_s_min"] for y, p in zip(ys, pts, strict=True)]
                hi = [p["samples_per_s_max"] - y for y, p in zip(ys, pts, strict=True)]
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o" + style, capsize=3, label=name,
                            color=colors[name])
            else:
                ax.plot(xs, ys, "o" + style, label=name, color=colors[name])
        ax.set_xlabel("workers")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(alpha=0.3)
        if key != "samples_per_s":
            ax.set_ylim(0, max(1.05, *(r.get(key) or 0 for r in rows)))
        elif max(r[key] for r in rows) > 20 * min(r[key] for r in rows):
            ax.set_yscale("log")  # models of very different speeds on one panel
    handles, labels = axes[0].get_legend_handles_labels()
    columns = min(4, max(1, len(labels)))
    rows_of_legend = -(-len(labels) // columns)
    fig.set_figheight(3.6 + 0.3 * rows_of_legend)
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.01), ncol=columns,
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.03 + 0.3 * rows_of_legend / fig.get_figheight(), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def race_figure(rows: Sequence[dict[str, Any]], results: dict[Any, list[dict[str, Any]]],
                path: Path, title: str = "", target: float | None = None) -> None:
    """A race: test accuracy against training time (every repeat, one colour per row of
    ``rows``, whose order is ``results``'), the target and the budget marked; beside it, each
    row's median time to the target with the repeats' range."""
    import math

    plt = require_matplotlib()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.6), dpi=80,
                                   gridspec_kw={"width_ratios": [3, 2]})
    names = [f"{r['strategy']} ({r['workers']} workers)" for r in rows]
    for i, (name, runs) in enumerate(zip(names, results.values(), strict=True)):
        for k, run in enumerate(runs):
            xs, ys = zip(*run["curve"], strict=True)
            ax.plot(xs, ys, "o-", color=f"C{i % 10}", alpha=0.9 if k == 0 else 0.35,
                    markersize=3, label=name if k == 0 else None)
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
    if rows:
        ax.axvline(rows[0]["budget_s"], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ys = list(range(len(rows)))
    reached = [r.get("time_to_target") for r in rows]
    width, low, high = [], [], []
    for t, r in zip(reached, rows, strict=True):
        finite = t is not None and math.isfinite(t)
        width.append(t if finite else 0.0)
        top = r.get("time_to_target_max")
        low.append(t - r["time_to_target_min"] if finite else 0.0)
        high.append(top - t if finite and math.isfinite(top) else 0.0)
    bars.barh(ys, width, xerr=[low, high], color=[f"C{i % 10}" for i in ys], capsize=3)
    for y, t in zip(ys, reached, strict=True):
        if t is not None and not math.isfinite(t):
            bars.text(0, y, " not reached", va="center", fontsize=8)
    bars.set_yticks(ys, names, fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("median time to " + (f"{100 * target:g}%" if target is not None
                                          else "the target") + " (s)")
    bars.grid(alpha=0.3, axis="x")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def report_figure(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Loss and accuracy of several runs against wall time and against samples seen.

    Training loss and accuracy come from the step records (rank 0's interval averages), test
    loss and accuracy from the epoch records (markers).
    """
    plt = require_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=80, sharey="row")
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        steps, epochs = run["steps"], run["epochs"]
        for col, x in enumerate(("elapsed_s", "samples")):
            ax_loss, ax_acc = axes[0][col], axes[1][col]
            if steps:
                xs = [r[x] for r in steps]
                ax_loss.plot(xs, [r["loss"] for r in steps], color=color, alpha=0.8,
                             label=f"{run['label']} train")
                ax_acc.plot(xs, [r["accuracy"] for r in steps], color=color, alpha=0.5)
            tested = [r for r in epochs if r.get("test_accuracy") is not None]
            if tested:
                xs = [r[x] for r in tested]
                ax_loss.plot(xs, [r["test_loss"] for r in tested], "o--", color=color,
                             label=f"{run['label']} test")
                ax_acc.plot(xs, [r["test_accuracy"] for r in tested], "o--", color=color)
    for col, xlabel in enumerate(("wall time (s)", "samples seen")):
        axes[0][col].set_ylabel("loss")
        axes[1][col].set_ylabel("accuracy (line: train, dots: test)")
        axes[1][col].set_xlabel(xlabel)
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
    axes[0][0].set_yscale("log")
    axes[0][1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
