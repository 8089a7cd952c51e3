"""Markdown tables from the JSON results of ``benchmarks/*.py`` and ``gradcomm.bench``.

    python benchmarks/report.py benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _f(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def step_time_tables(doc: dict[str, Any]) -> list[str]:
    meta = doc["meta"]
    load = meta.get("loadavg_start", [None])[0], meta.get("loadavg_end", [None])[0]
    lines = [
        f"`{meta['command']}` ({meta['world_size']} ranks, {meta['cpu_count']} CPUs, "
        f"{meta['date_utc']}, 1-min load average {_f(load[0], 1)} at start, "
        f"{_f(load[1], 1)} at end; {meta['steps']} interleaved timed steps per variant; "
        f"malloc: {meta.get('malloc', 'glibc')})",
        "",
        "| model | variant | median ms | IQR ms | x DDP | x old (same backend) "
        "| page faults/step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in doc["results"]:
        label = f"{res['model']} ({res['params'] / 1e6:.2f}M)"
        for name, v in res["variants"].items():
            lines.append(
                f"| {label} | {name} | {v['median_ms']:.1f} | {v['iqr_ms']:.1f} | "
                f"{_f(v.get('x_ddp'), 3)} | {_f(v.get('x_old'), 3)} | "
                f"{_f(v.get('page_faults_per_step'), 0)} |"
            )
            label = ""
    layouts = [(res["model"], name, v["buckets"]) for res in doc["results"]
               for name, v in res["variants"].items() if v.get("buckets")]
    if layouts:
        lines.append("")
        for model, name, lay in layouts:
            lines.append(
                f"- {model}, {name}: buckets {lay['bucket_mib']} MiB (first cap "
                f"{lay['first_bucket_cap_mb']} MiB; "
                + (f"in place: {lay['in_place']}; " if "in_place" in lay else "")
                + f"background_progress={lay['background_progress']})"
            )
    if doc.get("targets"):
        lines += ["", "| target | measured | holds |", "|---|---:|---|"]
        for t in doc["targets"]:
            lines.append(f"| {t['target']} | {t['ratio']:.3f}x | {'yes' if t['holds'] else 'no'} |")
    return lines


def sweep_tables(doc: dict[str, Any]) -> list[str]:
    meta = doc["meta"]
    lines = [
        f"`{meta['command']}` ({meta['world_size']} ranks, {meta['cpu_count']} CPUs, "
        f"{meta['date_utc']}, {meta['dtype']} {meta['op']}, time = {meta['time']})",
        "",
    ]
    for backend in dict.fromkeys(r["backend"] for r in doc["rows"]):
        rows = [r for r in doc["rows"] if r["backend"] == backend]
        lines += [
            f"| size (B) | count | {backend} time (us) | algbw (GB/s) | busbw (GB/s) | "
            f"raw {rows[0]['transport']} time (us) | raw busbw (GB/s) | overhead (us) | "
            "ratio |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['size']} | {r['count']} | {r['time_us']:.1f} | {r['algbw']:.3f} | "
                f"{r['busbw']:.3f} | {_f(r['raw_time_us'], 1)} | {_f(r['raw_busbw'], 3)} | "
                f"{_f(r['overhead_us'], 1)} | {_f(r['overhead_ratio'], 3)} |"
            )
        lines.append("")
        lines += _overhead_targets(backend, rows)
    return lines


def _overhead_targets(backend: str, rows: list[dict[str, Any]]) -> list[str]:
    """Issue 3: overhead vs the raw transport <= 5 % at >= 1 MiB and <= 30 us at 8 B."""
    out = []
    big = [r for r in rows if r["size"] >= 2**20 and r["overhead_ratio"] is not None]
    if big:
        worst = max(big, key=lambda r: r["overhead_ratio"])
        holds = all(r["overhead_ratio"] <= 1.05 for r in big)
        out.append(f"- {backend}, sizes >= 1 MiB: overhead ratio <= 1.05 "
                   f"{'holds' if holds else 'missed'} (worst {worst['overhead_ratio']:.3f} at "
                   f"{worst['size']} B)")
    small = [r for r in rows if r["size"] == 8 and r["overhead_us"] is not None]
    if small:
        us = small[0]["overhead_us"]
        out.append(f"- {backend}, 8 B: overhead <= 30 us {'holds' if us <= 30 else 'missed'} "
                   f"({us:.1f} us)")
    return [*out, ""] if out else []


def call_overhead_table(doc: dict[str, Any]) -> list[str]:
    """Markdown for a benchmarks/call_overhead.py result (one row per kind of call)."""
    meta = doc["meta"]
    out = [
        f"`{meta['command']}` ({meta['world_size']} ranks, {meta['cpu_count']} CPUs, "
        f"{meta['date_utc']}, {meta['bytes']} B, {meta['calls']} calls of each kind, "
        f"time = {meta['time']})",
        "",
        "| call | median us | 25th percentile us |",
        "|---|---:|---:|",
    ]
    out += [f"| {kind} | {v['median_us']:.1f} | {v['p25_us']:.1f} |"
            for kind, v in doc["kinds"].items()]
    out += ["", f"- comm - raw: {doc['overhead_us']:+.1f} us (ratio {doc['overhead_ratio']:.3f})",
            ""]
    return out


def step_breakdown_table(doc: dict[str, Any]) -> list[str]:
    """Markdown for a benchmarks/step_breakdown.py result (one row per variant, ms per phase)."""
    meta = doc["meta"]
    job = doc["median_ms"]
    local_bwd = job["local"]["backward"]
    out = [
        f"`{meta['command']}` ({meta['world_size']} ranks, {meta['date_utc']}, model "
        f"{meta['model']}, {meta['steps']} steps; ms, median over steps, max over ranks)",
        "",
        "| variant | forward | backward | of which gradcomm's hooks | backward beyond local's "
        "| optimizer | step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, ms in job.items():
        hooks = f"{ms['hooks']:.2f}" if name.startswith("gradcomm+") else ""
        extra = f"{ms['backward'] - local_bwd:.2f}" if name != "local" else ""
        out.append(f"| {name} | {ms['forward']:.2f} | {ms['backward']:.2f} | {hooks} | {extra} "
                   f"| {ms['optimizer']:.2f} | {ms['step']:.2f} |")
    return [*out, ""]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.files:
        doc = json.loads(path.read_text())
        print(f"### {path.name}\n")
        if "results" in doc:
            print("\n".join(step_time_tables(doc)))
        elif "kinds" in doc:
            print("\n".join(call_overhead_table(doc)))
        elif "median_ms" in doc:
            print("\n".join(step_breakdown_table(doc)))
        elif "rows" in doc:
            print("\n".join(sweep_tables(doc)))
        else:
            print(f"{path}: not a benchmark result", file=sys.stderr)
            return 1
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
