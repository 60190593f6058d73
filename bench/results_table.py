"""The benchmark table of docs/results.md, generated from bench/results.json (`python -m bench.results_table`).

tests/test_bench_results.py checks that docs/results.md holds this table verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.json"


def table_markdown(results: dict) -> str:
    lines = ["| benchmark | measured | value | goal | verdict | figures | command |", "|---|---|---|---|---|---|---|"]
    for bench in sorted(results):
        entry = results[bench]
        for row in entry["rows"]:
            unit = row["unit"]
            lines.append(f"| {bench} | {row['name']} | {row['value']:.3g}{unit} | {row['direction']} "
                         f"{row['goal']:g}{unit} | {'PASS' if row['passed'] else 'FAIL'} | "
                         f"{row['detail'].replace('|', '/')} | `{entry['command']}` |")
    return "\n".join(lines)


def main() -> None:
    print(table_markdown(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
