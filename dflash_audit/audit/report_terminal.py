"""The summary tables `compare` and `serve-check` print."""

from __future__ import annotations

import textwrap
from typing import Any

from tabulate import tabulate

from dflash_audit.audit.report import AuditReport
from dflash_audit.tau.along_context import AlongContext, side_by_side


def terminal_summary(report: AuditReport, width: int = 60) -> str:
    rows = [[f.severity, f.component + (f":{f.key}" if f.key else ""), f"#{f.pitfall}" if f.pitfall else "",
             textwrap.fill(f.message, width)] for f in report.findings]
    lines = [tabulate(rows, headers=["severity", "finding", "pitfall", "message"], tablefmt="simple_grid")
             if rows else "no findings"]
    if report.dynamic is not None:
        for method in report.dynamic.methods.values():
            lines.append(f"{method.label}: mean τ ours {method.mean['ours']:.3f}  ref {method.mean['ref']:.3f}"
                         if method.measured else f"{method.label}: τ not measured")
        dflash = report.dynamic.methods["dflash"]
        if dflash.along:
            lines.append(f"{dflash.label}: " + side_by_side(dflash.along))
        where = report.dynamic.precision
        if where:
            lines.append(f"target in {where['target_dtype']}, drafters in {where['drafter_dtype']}, on {where['device']}"
                         + (f" (target sharded: --device-map {where['device_map']})" if where.get("device_map") else ""))
            lines += [where["offline_exactness"]] if where.get("offline_exactness") else []
            if where.get("hidden_states"):
                engine = where["hidden_states"]
                made = (f" {engine['vllm_version']} ({engine['path']}); its records in {engine['records']}"
                        if "records" in engine else " (read from its cache)")
                lines.append(f"target states made by {engine['engine']}{made}")
        for name, row in report.dynamic.by_dtype.items():
            means = row["means"]["dflash"]
            text = "  ".join(f"{side} {means[side]:.3f}" if means[side] is not None else f"{side} not measured"
                             for side in ("ours", "ref"))
            overflow = ", ".join(f"{side} overflows ({module})" for side, module in row["overflow"].items())
            lines.append(f"DFlash τ in {name}: {text}" + (f"  {overflow}" if overflow else ""))
    lines += report.notes
    if report.serving is not None:
        for side, section in report.serving.items():
            lines += [f"will {side} serve as trained?", terminal_section(section)]
    count = len(report.divergences)
    line = f"{count} divergence{'s' if count != 1 else ''}"
    if report.serving is not None:
        serving = report.serving_divergences
        line += f", {serving} serving divergence{'s' if serving != 1 else ''}"
    lines.append(line)
    return "\n".join(lines)


def terminal_section(section: dict[str, Any], width: int = 70) -> str:
    lines = []
    for engine, report in section.items():
        state = "loads" if report["loads"] else "REFUSES"
        lines.append(f"{engine} {report['version']}: {state}")
        if report.get("step"):
            lines.append(f"  step: {report['step']}")
        rows = [[f["severity"], f["field"], textwrap.fill(f["message"], width), f["source"]]
                for f in report["findings"]]
        lines.append(tabulate(rows, headers=["severity", "field", "message", "engine source"],
                              tablefmt="simple_grid") if rows else "  serves as trained")
        if report["command"]:
            lines.append(f"  serve with: {report['command']}")
        lines += [f"  note: {note}" for note in report["notes"]]
        if report.get("live"):
            lines.append(live_table(report["live"]))
    return "\n".join(lines)


def prediction_line(prediction: dict[str, Any]) -> str:
    """The folder's keys as the engine reads them, replayed: the τ they are predicted to cost and what the engine
    gave (`live_check.prediction_summary`)."""
    keys = ", ".join(f"{r['key']} = {r['value']!r}" for r in prediction["readings"])
    left_out = ", ".join(r["key"] for r in prediction["not_replayed"])
    text = "  prediction: "
    if keys:
        text += (f"the engine's reading of {keys}: predicted τ {prediction['predicted_tau']:.3f} (cost "
                 f"{prediction['predicted_cost']:.3f}), served τ {prediction['served_tau']:.3f}; every round as "
                 f"predicted on {prediction['prompts_as_predicted']}/{prediction['prompts']} prompts "
                 f"({prediction['rounds_as_predicted']}/{prediction['rounds']} rounds"
                 + (f", {prediction['rounds_apart']} near the budget's end apart" if prediction.get("rounds_apart")
                    else "") + ")")
    return text + (f"{'; ' if keys else ''}not replayed (no setting of the audit's drafter for it): {left_out}"
                   if left_out else "")


def interval_words(figure: dict[str, Any]) -> str:
    return f"{figure['tau']:.3f} [{figure['interval'][0]:.3f}, {figure['interval'][1]:.3f}]"


# served τ at T > 0 against the interval predicted for it (None: the engine does not sample at the request's T)
SAMPLED_VERDICT = {True: "inside", False: "OUTSIDE", None: "not held to"}


def sampled_line(prediction: dict[str, Any]) -> str:
    """A live run at T > 0 (`SampledPrediction.held`): τ predicted and served, each with its 95% interval."""
    keys = ", ".join(f"{r['key']} = {r['value']!r}" for r in prediction["readings"])
    low, high = prediction["served_interval"]
    text = (f"  at temperature {prediction['temperature']:g}: audited τ {interval_words(prediction['audited_tau'])}"
            + (f"; with the engine's reading of {keys}, predicted τ {interval_words(prediction['predicted_tau'])} "
               f"(cost {interval_words(prediction['predicted_cost'])})" if keys else "")
            + f"; served τ {interval_words(prediction['served_tau'])} over {prediction['served_tau']['runs']} "
              f"generations, {SAMPLED_VERDICT[prediction['served_as_predicted']]} the interval predicted "
              f"for it [{low:.3f}, {high:.3f}]")
    left_out = ", ".join(r["key"] for r in prediction["not_replayed"])
    return text + (f"; not replayed (no setting of the audit's drafter for it): {left_out}" if left_out else "")


def sampled_table(live: dict[str, Any]) -> str:
    """A live run at T > 0: mean τ per prompt over its seeds, served beside the audit's sampled replays."""
    rows = [[p["id"], f"{p['served_tau']:.3f}", f"{p['predicted_tau']:.3f}", f"{p['audited_tau']:.3f}",
             len(p["served_runs"])] for p in live["prompts"]]
    head = (f"  live: vLLM {live['version']} ({live['python']}), temperature {live['temperature']:g}, drafts sampled, "
            f"seeds {','.join(map(str, live['seeds']))} per prompt")
    return (head + "\n" + tabulate(rows, headers=["prompt", "served τ", "predicted τ", "audited τ", "runs"],
                                   tablefmt="simple") + "\n" + sampled_line(live["prediction"]))


def live_table(live: dict[str, Any]) -> str:
    """The served rounds per prompt, as `serve-check --live` prints them (and the README shows them)."""
    if not live.get("ran"):
        return f"  live: not run: {live.get('refused')}"
    if live.get("sampled"):
        return sampled_table(live)
    rows = [[p["id"], f"{p['served_tau']:.3f}", f"{p['audited_tau']:.3f}",
             f"{p['rounds_equal']}/{p['rounds']}" + (f" ({p['rounds_apart']} apart)" if p.get("rounds_apart") else ""),
             p["first_diff_round"] or "-", ", ".join(p.get("explained_by", [])) or "-",
             "yes" if p["greedy_identical"] else "NO"] for p in live["prompts"]]
    head = f"  live: {'llama.cpp' if live.get('engine') == 'llamacpp' else 'vLLM'} {live['version']} ({live['python']}), greedy output identical: " \
           f"{'yes' if live['greedy_identical'] else 'NO'}"
    text = head + "\n" + tabulate(rows, headers=["prompt", "served τ", "audited τ", "rounds equal", "first diff",
                                                 "explained by", "greedy same"], tablefmt="simple")
    if live.get("prediction"):
        text += "\n" + prediction_line(live["prediction"])
    if live.get("along_context"):  # the audit's replay and the engine's rounds, by the position of each round
        text += "\n" + side_by_side({side: AlongContext.model_validate(along)
                                     for side, along in live["along_context"].items()})
    return text
