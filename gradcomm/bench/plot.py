"""Plot bus bandwidth against message size from sweep results (needs matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .metrics import format_size
from .results import SweepResult, SweepRow

__all__ = ["plot_busbw", "require_matplotlib"]


def require_matplotlib() -> Any:
    """Return matplotlib's ``Figure`` class.

    Raises:
        ImportError: matplotlib is missing; the message gives the pip command.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib (or pip install gradcomm[plot])"
        ) from exc
    return Figure


def plot_busbw(
    results: Sequence[SweepResult], path: str | Path, *, title: str | None = None
) -> list[str]:
    """Draw busbw (GB/s) against message size (bytes, log scale) and save it to ``path``.

    One solid line per gradcomm backend and one dashed line per raw transport, for every
    (backend, world size, dtype, op) found in ``results``; the world size, dtype and op appear in
    the labels only where the results differ in them. Results that measure the same size for the
    same backend are separate runs and get lines of their own, labelled with their date.

    Args:
        results: sweeps, e.g. from :func:`~gradcomm.bench.results.read_json` of several files.
        path: image file to write; the format follows the suffix (``.png``, ``.svg``, ``.pdf``).
        title: figure title (default: a summary of the runs).

    Returns:
        The labels of the lines drawn, in drawing order.

    Raises:
        ImportError: matplotlib is missing (the message gives the pip command).
        ValueError: no rows to plot.
    """
    figure_cls = require_matplotlib()
    from matplotlib.ticker import FuncFormatter

    rows = [row for res in results for row in res.rows]
    if not rows:
        raise ValueError("no sweep rows to plot")
    # Results that measure the same size for the same (backend, ranks, dtype, op) are separate
    # runs: they get lines of their own, labelled with their date, instead of one zigzag line.
    # Results that cover different sizes (a small-message and a large-message sweep) join up.
    run_of = []  # per result: the lowest run none of whose (backend, ..., size) it repeats
    taken: dict[tuple[str, int, str, str, int], set[int]] = {}
    for res in results:
        keys = {(r.backend, r.world_size, r.type, r.redop, r.size) for r in res.rows}
        run = 0
        while any(run in taken.get(k, ()) for k in keys):
            run += 1
        run_of.append(run)
        for k in keys:
            taken.setdefault(k, set()).add(run)
    many_runs = max(run_of) > 0
    vary = {
        "ranks": len({r.world_size for r in rows}) > 1,
        "type": len({r.type for r in rows}) > 1,
        "redop": len({r.redop for r in rows}) > 1,
    }
    groups: dict[tuple[str, int, str, str, int], list[SweepRow]] = {}
    run_date: dict[int, str] = {}
    for i, res in enumerate(results):
        run_date.setdefault(run_of[i], str(res.meta.get("date_utc", f"run {run_of[i] + 1}")))
        for row in res.rows:
            key = (row.backend, row.world_size, row.type, row.redop, run_of[i])
            groups.setdefault(key, []).append(row)

    fig = figure_cls(figsize=(8.0, 5.0))
    ax = fig.subplots()
    labels: list[str] = []
    for index, (key, group) in enumerate(sorted(groups.items())):
        backend, world_size, dtype, redop, run = key
        group = sorted(group, key=lambda r: r.size)
        extra = [
            f"{world_size} ranks" if vary["ranks"] else "",
            dtype if vary["type"] else "",
            redop if vary["redop"] else "",
            run_date[run][:16] if many_runs else "",
        ]
        suffix = ", ".join(e for e in extra if e)
        suffix = f" ({suffix})" if suffix else ""
        color = f"C{index % 10}"
        label = f"gradcomm {backend}{suffix}"
        ax.plot([r.size for r in group], [r.busbw for r in group], "o-", color=color,
                markersize=3, label=label)
        labels.append(label)
        raw = [r for r in group if r.raw_busbw is not None]
        if raw:
            raw_label = f"raw {raw[0].transport}{suffix}"
            ax.plot([r.size for r in raw], [r.raw_busbw for r in raw], "s--", color=color,
                    markersize=3, alpha=0.7, label=raw_label)
            labels.append(raw_label)
    ax.set_xscale("log", base=2)
    lo = int(math.log2(min(r.size for r in rows)))
    hi = math.ceil(math.log2(max(r.size for r in rows)))
    step = max(1, math.ceil((hi - lo + 1) / 12))  # at most about 12 labelled sizes
    ax.set_xticks([2.0**k for k in range(lo, hi + 1, step)])
    ax.set_xlim(2.0 ** (lo - 0.3), 2.0 ** (hi + 0.3))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_size(int(x))))
    for tick in ax.get_xticklabels():
        tick.set_rotation(45)
    ax.set_xlabel("message size per rank")
    ax.set_ylabel("busbw (GB/s) = algbw * 2(n-1)/n")
    if title is None:
        sizes = sorted({r.world_size for r in rows})
        title = (
            f"all_reduce bus bandwidth, {'/'.join(map(str, sizes))} ranks, "
            f"{'/'.join(sorted({r.type for r in rows}))}"
        )
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    return labels
