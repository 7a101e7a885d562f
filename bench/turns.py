"""What the focused benches share: methods taking turns after a warm-up, and their table.

``bench.strided``, ``bench.dcp`` and ``bench.sharded`` each time a few
methods, every run in fresh processes; this runs them in turns (so no
method is favoured by what ran before it) and writes the median table as
markdown and JSON.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

Run = Callable[[str], dict]  # method -> {"load_s", "verified", and "rss_growth" where measured}


def take_turns(methods: dict[str, str], run: Run, runs: int, *, warm_up: bool = True) -> dict[str, list[dict]]:
    """Every method once to warm up (page cache, import caches; unless not ``warm_up``), then ``runs`` rounds of
    each in turn."""
    for method in methods.values() if warm_up else ():
        run(method)
    results: dict[str, list[dict]] = {label: [] for label in methods}
    for _ in range(runs):
        for label, method in methods.items():
            results[label].append(run(method))
    return results


def after(no_warm_up: bool) -> str:
    """How the tables' intros say the runs were preceded: by a discarded warm-up, or (``--no-warm-up``) by none."""
    return "with no warm-up" if no_warm_up else "after a warm-up"


def write_table(out: Path, name: str, intro: str, results: dict[str, list[dict]], ratio_to: Callable[[str], str],
                ratio_heading: str, extra: dict) -> None:
    """``out/name.md`` and ``.json``: per method the median load, its spread, its ratio to the row
    ``ratio_to(label)`` names, peak RSS growth where measured, and whether every run was verified."""
    with_rss = all("rss_growth" in result for rows in results.values() for result in rows)
    with_storage = all("storage_bytes" in result for rows in results.values() for result in rows)
    report = {}
    for label, rows in results.items():
        times = [row["load_s"] for row in rows]
        report[label] = {"load_s": statistics.median(times), "runs": times, "verified": all(row["verified"] for row in rows)}
        if with_rss:
            report[label]["rss_growth"] = statistics.median(row["rss_growth"] for row in rows)
        if with_storage:
            known = [row["storage_bytes"] for row in rows if row["storage_bytes"] is not None]
            report[label]["storage_bytes"] = statistics.median(known) if known else None
    storage_heading = " storage GB |" if with_storage else ""
    lines = [intro, "", f"| method | load s | min-max s | {ratio_heading} |{' RSS growth GB |' if with_rss else ''}"
                        f"{storage_heading} verified |",
             f"| --- | ---: | ---: | ---: |{' ---: |' if with_rss else ''}{' ---: |' if with_storage else ''} --- |"]
    for label, summary in report.items():
        times = summary["runs"]
        rss = f" {summary['rss_growth'] / 1e9:.2f} |" if with_rss else ""
        if with_storage:
            rss += " - |" if summary["storage_bytes"] is None else f" {summary['storage_bytes'] / 1e9:.2f} |"
        lines.append(f"| {label} | {summary['load_s']:.3f} | {min(times):.3f}-{max(times):.3f} | "
                     f"{summary['load_s'] / report[ratio_to(label)]['load_s']:.2f} |{rss} "
                     f"{'yes' if summary['verified'] else 'NO'} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**extra, "results": report}, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
