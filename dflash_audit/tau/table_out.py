"""The τ table as terminal text, JSON (`dflash-audit/tau-table-1`) and one self-contained HTML page with a
bar chart per prompt set; a published figure sits beside each cell it applies to, with its source."""

from __future__ import annotations

import html
import json
from pathlib import Path

from tabulate import tabulate

from foundation.atomic import atomic_write_bytes, atomic_write_text

SCHEMA = "dflash-audit/tau-table-1"


def cell_label(cell: dict) -> str:
    decoding = cell["decoding"] if cell["budget"] is None else f"{cell['decoding']}@{cell['budget']}"
    chat = "" if cell["chat"] == "default" else f" {cell['chat']}"
    return f"{cell['method']} {decoding} T={cell['temperature']:g}{chat}"


def tau_text(cell: dict) -> str:
    text = f"{cell['tau']:.3f}"
    if cell["seed_range"] is not None:
        low, high = cell["seed_range"]
        text += f" [{low:.3f}, {high:.3f}] seeds {','.join(str(s) for s in cell['seeds'])}"
    return text


def published_text(cell: dict) -> str:
    return "; ".join(f"{f['tau']:.2f} ({f['source']}, {f['tau_method']})" for f in cell["published"]) or ""


def terminal_table(cells: list[dict]) -> str:
    rows = [[c["set"], c["count"], cell_label(c), tau_text(c), published_text(c)] for c in cells]
    return tabulate(rows, headers=["set", "responses", "method decoding T chat", "τ [range across seeds]",
                                   "published"], tablefmt="github")


def payload(cells: list[dict], sets: list[dict], context: dict, skipped: list[str]) -> dict:
    return {"schema": SCHEMA, **context, "sets": sets, "skipped": skipped, "cells": cells}


def write_json(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=2)
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(text))


CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}th{background:#f3f3f3}.pub{color:#a33}
svg text{font-size:11px}.chart{margin:0 0 2em 0}"""


def bar_chart(set_name: str, cells: list[dict]) -> str:
    """Horizontal bars of τ per cell of one set; a published figure is a red tick on its bar's scale."""
    width, left, row = 640, 260, 22
    top = max([c["tau"] for c in cells] + [f["tau"] for c in cells for f in c["published"]] + [1.0])
    scale = (width - left - 60) / top
    parts = [f'<svg class="chart" role="img" aria-label="τ per cell, {html.escape(set_name)}" width="{width}" '
             f'height="{row * len(cells) + 10}" xmlns="http://www.w3.org/2000/svg">']
    for i, cell in enumerate(cells):
        y = 5 + i * row
        bar = cell["tau"] * scale
        parts.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{html.escape(cell_label(cell))}</text>')
        parts.append(f'<rect class="bar" x="{left}" y="{y + 3}" width="{bar:.1f}" height="{row - 8}" fill="#4a7bd0"/>')
        parts.append(f'<text x="{left + bar + 4:.1f}" y="{y + 14}">{cell["tau"]:.2f}</text>')
        for fig in cell["published"]:
            x = left + fig["tau"] * scale
            parts.append(f'<line class="published" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + row - 2}" '
                         f'stroke="#c33" stroke-width="2"><title>published {fig["tau"]:.2f} '
                         f'({html.escape(fig["source_text"])})</title></line>')
    parts.append("</svg>")
    return "".join(parts)


def stop_ids_text(data: dict) -> str:
    """A report's `stop_ids` with their `stop_id_sources` (written by foundation.target_vocab.StopIds.report)."""
    from foundation.target_vocab import StopIds

    return StopIds.from_report(data).describe()


def html_page(data: dict) -> str:
    esc = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>dflash-audit: τ table</title>",
           f"<style>{CSS}</style></head><body><h1>τ table</h1>",
           f"<p>drafter <code>{esc(str(data['drafter']))}</code>, target <code>{esc(str(data['target']))}</code>, "
           f"max new tokens {data['max_new_tokens']}; published figures for: "
           f"{esc(str(data.get('published_target') or 'none (target not one the figures are for)'))}</p>",
           f"<p>stop ids (live, zlab-loop): {esc(stop_ids_text(data))}</p>"]
    out.append("<h2>Prompt sets</h2><table><tr><th>set</th><th>file</th><th>count</th><th>selection</th>"
               "<th>rendering</th></tr>")
    for s in data["sets"]:
        out.append(f"<tr><td>{esc(s['name'])}</td><td>{esc(s['path'])}</td><td>{s['count']} of {s['rows']}</td>"
                   f"<td>{esc(s['selection'])}</td><td>{esc(s['rendering'])}</td></tr>")
    out.append("</table>")
    if data.get("findings"):  # e.g. a chat-template setting other than the drafter's declared one (tau/declared.py)
        out.append("<h2>Findings</h2><table class='findings'><tr><th>severity</th><th>finding</th><th>message</th></tr>")
        for f in data["findings"]:
            finding = f["component"] + (f":{f['key']}" if f.get("key") else "")
            out.append(f"<tr class='{esc(f['severity'])}'><td>{esc(f['severity'])}</td><td>{esc(finding)}</td>"
                       f"<td>{esc(f['message'])}</td></tr>")
        out.append("</table>")
    for name in dict.fromkeys(c["set"] for c in data["cells"]):
        cells = [c for c in data["cells"] if c["set"] == name]
        out.append(f"<h2 class='set'>{esc(name)}</h2>")
        out.append(bar_chart(name, cells))
        out.append("<table class='cells'><tr><th>method</th><th>decoding</th><th>T</th><th>chat template</th>"
                   "<th>responses</th><th>τ</th><th>seeds (τ each)</th><th>published</th></tr>")
        for c in cells:
            seeds = ("" if c["seeds"] is None else
                     ", ".join(f"{s}: {t:.3f}" for s, t in zip(c["seeds"], c["per_seed"])))
            chat = c["chat_template"]
            chat_text = f"{chat['mode']}{' ' + chat['file'] if chat['file'] else ''} {json.dumps(chat['kwargs'])}"
            pub = "<br>".join(f"<span class='pub'>{f['tau']:.2f}</span> {esc(f['source_text'])} ({esc(f['tau_method'])})"
                              for f in c["published"])
            decoding = c["decoding"] + (f" (budget {c['budget']})" if c["budget"] else "")
            out.append(f"<tr><td>{esc(c['method'])}</td><td>{esc(decoding)}</td><td>{c['temperature']:g}</td>"
                       f"<td>{esc(chat_text)}</td><td>{c['count']}</td><td>{esc(tau_text(c))}</td>"
                       f"<td>{esc(seeds)}</td><td>{pub}</td></tr>")
        out.append("</table>")
    if data["skipped"]:
        out.append("<h2>Not run</h2><ul>" + "".join(f"<li>{esc(s)}</li>" for s in data["skipped"]) + "</ul>")
    out.append("</body></html>")
    return "".join(out)


def write_html(path: Path, data: dict) -> None:
    text = html_page(data)
    atomic_write_text(Path(path), text)
