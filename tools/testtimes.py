"""The suite's time by kind of test, from a JUnit XML report: the table of docs/testing.md.

    python -m pytest -q --junitxml=times.xml ...      # each make test* writes one: data/test-times-test.xml, ...
    python -m tools.testtimes data/test-times-test.xml [--files] [--slowest 30]

A kind is what a test spends its time on (a benchmark's own run, torchrun's ranks, a CLI process, a server
on 127.0.0.1, ...), named by the test file's kind in :data:`KINDS`; a file not listed there is "in process".
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from defusedxml import ElementTree

# Each test file by what its tests spend their time on (a file of several kinds by the largest)
KINDS = {
    "benchmarks' own runs": ("test_bench", "test_bench_remote"),
    "rank launches (torchrun)": ("test_sharded", "test_group_loads", "test_dcp", "test_pipeline_stages"),
    "zoo sample": ("test_zoo",),
    "fuzz replays and corpus": ("test_fuzz_short", "test_fuzz_runner", "test_corpus", "test_properties"),
    "CLI processes": ("test_cli", "test_output_safety", "test_process_state", "test_progress", "test_completion"),
    "servers on 127.0.0.1": ("test_remote_http", "test_remote_s3", "test_remote_gcs", "test_remote_azure",
                             "test_remote_hub", "test_remote_servers", "test_s3_server", "test_remote_listings",
                             "test_remote_safety", "test_hub", "test_fake_hub"),
    "memory probes": ("test_peak_memory", "test_memory", "test_pickle_budgets", "test_hf_bounds"),
    "wheel and docs builds": ("test_wheel", "test_docs", "test_environment"),
    "oracles (differential, deferred, hf, vision)": ("test_differential", "test_deferred", "test_hf", "test_vision"),
}
KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}


def read(path: Path) -> list[tuple[str, float, bool]]:
    """(test id, seconds, skipped) of every test case the report holds."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append((name, float(case.get("time", 0.0)), case.find("skipped") is not None))
    return cases


def kind_of(test_id: str) -> str:
    module = test_id.split("::")[0].rsplit(".", 1)[-1]
    return KIND_OF.get(module, "in process")


def table(cases: list[tuple[str, float, bool]], key) -> list[tuple[str, int, float]]:
    """(group, tests, minutes), the slowest group first."""
    tests, seconds = defaultdict(int), defaultdict(float)
    for test_id, spent, skipped in cases:
        if not skipped:
            tests[key(test_id)] += 1
            seconds[key(test_id)] += spent
    return sorted(((g, tests[g], seconds[g] / 60) for g in tests), key=lambda row: -row[2])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--files", action="store_true", help="a row a test file, not a row a kind")
    parser.add_argument("--slowest", type=int, default=0, help="then list the N slowest tests")
    args = parser.parse_args(argv)
    cases = read(args.report)
    key = (lambda test_id: test_id.split("::")[0].rsplit(".", 1)[-1]) if args.files else kind_of
    rows = table(cases, key)
    print(f"| {'file' if args.files else 'kind'} | tests | minutes |\n|---|---:|---:|")
    for group, count, minutes in rows:
        print(f"| {group} | {count:,} | {minutes:.1f} |")
    print(f"| all | {sum(r[1] for r in rows):,} | {sum(r[2] for r in rows):.1f} |")
    for test_id, spent, _ in sorted(cases, key=lambda case: -case[1])[:args.slowest]:
        print(f"{spent:8.1f} s  {test_id}")


if __name__ == "__main__":
    main(sys.argv[1:])
