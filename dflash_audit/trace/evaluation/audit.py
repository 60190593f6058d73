"""A team's own evaluator, held to z-lab's loop: `dflash-audit trace -- python eval.py ARGS` with no line added.

The recording (dflash_audit/trace/evaluation/recorder.py) is rebuilt into rounds per prompt (evaluation/rounds.py); z-lab's own
`dflash_generate` is replayed on the same prompts, with the drafter folder the evaluated module was loaded from
(its weights checked against the module's by value) and the same target, cut at the target's stop ids
(evaluation/replay.py). The report says:
- which τ the evaluator's own number (`trace.tau`) is, by value, and its gap to z-lab's τ with the paired bootstrap
  interval (evaluation/tau.py);
- per prompt, the first round that parts from z-lab's and why (evaluation/why.py): every round's inputs held to z-lab's
  loop, and at the parting round the drafter's output held to z-lab's drafter; one root cause is one finding, its
  prompts and first rounds listed;
- at T > 0 (rounds are sampled: no parting round is defined), the acceptance per draft position against z-lab's
  loop at the same temperature, each with its paired interval.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from catalogue.findings import Finding, FindingsReport, sort_findings
from dflash_audit.rounds.assess import merge
from dflash_audit.tau.along_context import DEFAULT_BIN_TOKENS
from dflash_audit.trace.evaluation.manifest import check_vocabulary
from dflash_audit.trace.evaluation.recorder import read_evaluation
from dflash_audit.trace.evaluation.replay import TargetStates, zlab_replay
from dflash_audit.trace.evaluation.rounds import SAME, PromptRun, rebuild, relative
from dflash_audit.trace.evaluation.tau import acceptance, identify, mean, mean_of_means, paired_statistic, position_gaps
from dflash_audit.trace.evaluation.why import EvaluatorLocalizer, Reference
from dflash_audit.target_values import tolerance
from dflash_audit.trace.record.recording import compile_notes
from foundation.atomic import atomic_write_bytes
from foundation.errors import AuditError

SCHEMA = "dflash-audit/trace-evaluation-report/1"
INPUT_CHECKS = ("context_features", "block", "positions", "acceptance")


@dataclass
class EvaluationReport(FindingsReport):
    findings: list[Finding]
    prompts: list[dict]
    tau: dict
    facts: dict
    notes: list[str] = field(default_factory=list)
    positions: list[dict] = field(default_factory=list)
    along_context: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from dflash_audit.audit.report_json import _finite
        from foundation.packages import installed_versions

        return _finite({"schema": SCHEMA, "findings": [f.to_dict() for f in self.findings], "tau": self.tau,
                        "prompts": self.prompts, "positions": self.positions, "facts": self.facts,
                        "along_context": {k: v for k, v in self.along_context.items() if not k.endswith("table")},
                        "notes": self.notes, "versions": installed_versions(), "exit_status": self.exit_status})

    def summary(self, width: int = 76) -> str:
        from tabulate import tabulate

        rows = [[f.severity, f"{f.component}:{f.key}", textwrap.fill(f.message, width)] for f in self.findings]
        lines = [tabulate(rows, headers=["severity", "finding", "message"], tablefmt="simple_grid") if rows
                 else "no findings: every round is z-lab's"]
        lines.append(f"τ: {self.tau['sentence']}")
        table = [[p["prompt"], p["prompt_tokens"], len(p["rounds"]), f"{p['tau']:.3f}", f"{p['zlab_tau']:.3f}",
                  p["first_parting_round"] or "-"] for p in self.prompts]
        lines.append(tabulate(table, headers=["prompt", "tokens", "rounds", "τ (theirs)", "τ (z-lab)",
                                              "parts at round"], tablefmt="simple"))
        if self.positions:
            lines.append(tabulate([[p["position"], f"{p['theirs']:.3f}", f"{p['zlab']:.3f}",
                                    f"[{p['low']:+.3f}, {p['high']:+.3f}]"] for p in self.positions],
                                  headers=["draft", "accepted (theirs)", "(z-lab)", "gap 95%"], tablefmt="simple"))
        if self.along_context:
            lines.append("τ along the context, the evaluator's rounds:\n" + self.along_context["table"])
        lines.extend(f"note: {note}" for note in self.notes)
        lines.append(f"{len(self.divergences)} divergence{'s' if len(self.divergences) != 1 else ''}")
        return "\n".join(lines)


def _load(recording, target_dir: Path | None, drafter_dir: Path | None, flag: str):
    from foundation.placement import Placement, resolve_device
    from foundation.target import load_target
    from reference_adapters.zlab_adapter import load_zlab_model

    manifest = recording.manifest
    target_path = Path(target_dir) if target_dir else Path(manifest["target"]["path"] or ".")
    if not (target_path / "config.json").is_file():
        raise AuditError(f"{flag} {recording.folder}: the evaluated target's folder is not known "
                         f"({target_path}): give it with --target DIR")
    dtype = getattr(torch, manifest["target"].get("dtype") or "float32", torch.float32)
    placement = Placement(resolve_device("auto"), dtype, "the evaluated target's")
    target, tokenizer = load_target(target_path, placement)
    check_vocabulary(manifest, recording.tensors, target.config.vocab_size, f"{flag} {recording.folder}")
    return target, tokenizer, target_path, placement, load_zlab_model


def _drafter_dir(recording, module: int, drafter_dir: Path | None, target_path: Path, flag: str) -> tuple[Path, dict]:
    """The drafter's z-lab folder: --drafter, else the one the module was loaded from (its `name_or_path`), else the
    folder named on the evaluator's command line whose weights hold the module's, by value (a team's own class
    loading z-lab's files itself)."""
    entry = recording.manifest["modules"][module]
    if drafter_dir:
        return Path(drafter_dir), entry
    if entry["path"] and (Path(entry["path"]) / "config.json").is_file():
        return Path(entry["path"]), entry
    wanted = {_key(v) for v in entry["fingerprints"].values() if _known(v)}
    for arg in recording.manifest.get("context", {}).get("argv", []):
        folder = Path(str(arg))
        if folder.is_dir() and (folder / "config.json").is_file() and folder.resolve() != target_path.resolve() \
                and wanted & _folder_keys(folder):
            return folder, entry
    raise AuditError(f"{flag} {recording.folder}: the drafter ({entry['class']}) names no folder it was loaded from, "
                     "and no folder on the evaluator's command line holds its weights: give it with --drafter DIR")


def _key(fingerprint: list) -> tuple:
    return (tuple(fingerprint[0]), round(fingerprint[1], 3), round(fingerprint[2], 3))


def _known(fingerprint: list) -> bool:
    """A fingerprint with its sums: one of a tensor held in shards across ranks (FSDP2) has its shape only."""
    return fingerprint[1] is not None and fingerprint[2] is not None


def _folder_keys(folder: Path) -> set[tuple]:
    from safetensors import safe_open

    keys = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                t = handle.get_tensor(name)
                if t.is_floating_point():
                    f = t.double()
                    keys.add((tuple(t.shape), round(float(f.sum()), 3), round(float((f * f).sum()), 3)))
    return keys


def _weights_check(twin, recording) -> tuple[list[str], list[str]]:
    """The folder's tensors not found by value (shape, sum, sum of squares) among the evaluated drafter's modules',
    and those that could not be compared: not found, of a shape only tensors held in shards had (their sums unknown)."""
    fingerprints = [v for m in recording.manifest["modules"] for v in m["fingerprints"].values()]
    theirs = {_key(v) for v in fingerprints if _known(v)}
    unread_shapes = {tuple(v[0]) for v in fingerprints if not _known(v)}
    missing, unread = [], []
    for name, tensor in twin.state_dict().items():
        if not tensor.is_floating_point():
            continue
        f = tensor.detach().double()
        if (tuple(tensor.shape), round(float(f.sum()), 3), round(float((f * f).sum()), 3)) not in theirs:
            (unread if tuple(tensor.shape) in unread_shapes else missing).append(name)
    return missing, unread


class NoRounds(AuditError):
    """An evaluation recording with no drafter round in it: for a command just traced, the command's doing."""


def audit_evaluation_folder(folder: Path, report_dir: Path, flag: str, target_dir: Path | None,
                            drafter_dir: Path | None, temperature: float | None, json_path: Path | None,
                            bin_tokens: int = DEFAULT_BIN_TOKENS):
    recording = read_evaluation(folder, flag)
    report = audit_evaluation(recording, flag, target_dir, drafter_dir, temperature, bin_tokens)
    data = report.to_dict()
    text = json.dumps(data, indent=2, default=str) + "\n"
    Path(report_dir).mkdir(parents=True, exist_ok=True)
    for path in [report_dir / "report.json"] + ([json_path] if json_path is not None else []):
        atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(text))
    write_html(report, report_dir / "index.html")
    return report


def audit_evaluation(recording, flag: str = "--from", target_dir: Path | None = None,
                     drafter_dir: Path | None = None, temperature: float | None = None,
                     bin_tokens: int = DEFAULT_BIN_TOKENS) -> EvaluationReport:
    from foundation.target_vocab import stop_token_ids

    target, tokenizer, target_path, placement, load_zlab_model = _load(recording, target_dir, drafter_dir, flag)
    stop_ids = list(stop_token_ids(target_path, tokenizer).ids)
    states_cache: dict[tuple, TargetStates] = {}

    def states_of(tokens: list[int]) -> TargetStates:
        key = tuple(tokens)
        if key not in states_cache:
            states_cache.clear()
            states_cache[key] = TargetStates(target, tokens)
        return states_cache[key]

    def holds_features(t: torch.Tensor, prompt: list[int]) -> bool:
        states = states_of(prompt)
        width = states.hidden[0].shape[-1]
        rows = min(t.shape[0], len(prompt))
        if t.shape[-1] % width or rows == 0:
            return False
        # The rows from the prompt's start, else its last rows (a drafter context capped at fewer rows than it).
        aligned = [(t[:rows], list(range(rows))), (t[-rows:], list(range(len(prompt) - rows, len(prompt))))]
        return any(states.name_rows(fed[:, j * width:(j + 1) * width], positions)[0] is not None
                   for fed, positions in aligned for j in range(t.shape[-1] // width))

    rebuilt = rebuild(recording, target, stop_ids, holds_features)
    if rebuilt.drafter_module is None or not rebuilt.prompts:
        raise NoRounds(f"{flag} {recording.folder}: no drafter round was recorded: no module was fed the target's "
                         "features and verified by the target")
    drafter_path, entry = _drafter_dir(recording, rebuilt.drafter_module, drafter_dir, target_path, flag)
    twin = load_zlab_model(drafter_path).to(placement.device, placement.dtype)
    notes = [*rebuilt.notes, *compile_notes(recording.manifest)]
    missing, unread = _weights_check(twin, recording)
    if len(missing) == len([t for t in twin.state_dict().values() if t.is_floating_point()]):
        raise AuditError(f"{flag} {recording.folder}: the evaluated drafter ({entry['class']}) holds none of "
                         f"{drafter_path}'s weights: give the folder it was loaded from with --drafter DIR")
    if missing:
        notes.append(f"{len(missing)} of {drafter_path}'s tensors are not found by value in the evaluated drafter "
                     f"(first: {missing[0]}): its weights are not all the folder's")
    if unread:
        notes.append(f"{len(unread)} of {drafter_path}'s tensors were not compared with the evaluated drafter's "
                     f"(first: {unread[0]}): it held them in shards across ranks, and rank 0 records its own shard "
                     "only")
    sampled = _sampled(rebuilt.prompts)
    if sampled and temperature is None:
        raise AuditError(f"{flag} {recording.folder}: the evaluator samples (its drafts are not its drafter's argmax): "
                         "give its temperature with --temperature T")
    temperature = float(temperature or 0.0)
    length = getattr(twin.config, "max_position_embeddings", None)
    ref = Reference(twin, target, stop_ids, ((int(length), "the drafter's max_position_embeddings"),)
                    if isinstance(length, int) else (), tolerance(recording.manifest["target"].get("dtype") or ""))
    return _assess(recording, rebuilt.prompts, ref, states_of, temperature, notes, drafter_path, target_path, entry,
                   bin_tokens)


def _sampled(runs: list[PromptRun]) -> bool:
    for run in runs:
        for rnd in run.rounds:
            if rnd.draft is not None and rnd.draft.drafts and rnd.block[1:] != rnd.draft.drafts[: len(rnd.block) - 1]:
                return True
    return False


def _assess(recording, runs: list[PromptRun], ref: Reference, states_of, temperature: float, notes: list[str],
            drafter_path: Path, target_path: Path, entry: dict, bin_tokens: int) -> EvaluationReport:
    localized: list[Finding] = []  # each prompt's causes, at their first rounds (the localizer's findings)
    prompts: list[dict] = []
    zlab_rounds, zlab_unstopped, their_rounds, all_replays = [], [], [], []
    their_drafted, zlab_drafted = [], []  # per prompt, per observed round: (tokens added, tokens drafted)
    seeds = 1 if temperature == 0 else 8
    fixed_text = False
    # At T > 0 a prompt's last round is not observed (no verification follows it, and its acceptance was sampled):
    # it is left out on both sides.
    observed = (lambda lengths: lengths) if temperature == 0 else (lambda lengths: lengths[:-1])  # noqa: E731
    if temperature > 0:
        notes.append("at T > 0 each prompt's last round is left out on both sides: no verification follows it, and "
                     "its acceptance was sampled")
    for run in runs:
        lengths = run.lengths
        their_rounds.append(observed(lengths))
        their_drafted.append(observed([(r.produced, len(r.block) - 1) for r in run.rounds if r.produced is not None]))
        max_new = 1 + sum(lengths)
        replays = [zlab_replay(ref.twin, ref.target, run.prompt, max_new, ref.stop_ids, temperature, seed)
                   for seed in range(seeds)]
        zlab_rounds.append([n for r in replays for n in observed(r.lengths)])
        zlab_drafted.append([pair for r in replays for pair in observed([(n.produced, len(n.block) - 1)
                                                                          for n in r.rounds])])
        unstopped = replays[0]
        if replays[0].stopped and temperature == 0:
            unstopped = zlab_replay(ref.twin, ref.target, run.prompt, max_new, None)
        zlab_unstopped.append(unstopped.lengths)
        all_replays.append(replays[0])
    # The comparison is the one core's for every source of rounds (dflash_audit/rounds/): this evaluator is one, its
    # localizer called at each prompt's first parting round; the prompts that never part are held round by round too.
    localizer = EvaluatorLocalizer(ref, states_of, runs, temperature)
    assessment = _core_assessment(recording, runs, all_replays, ref, localizer) if temperature == 0 else None
    for p, run in enumerate(runs):
        replay = all_replays[p]
        parting = assessment.rows[p]["first_diff_round"] if assessment is not None else None
        found = localizer.localized(p, parting)
        localized.extend(found.findings)
        if any(r.kept and r.read_from == "next" and r.kept[-1] != r.target_argmax[min(r.produced - 1,
               len(r.target_argmax) - 1)] for r in run.rounds) and temperature == 0:
            fixed_text = True
        prompts.append({"prompt": run.index, "prompt_tokens": len(run.prompt), "rounds": run.lengths,
                        "zlab_rounds": replay.lengths, "tau": mean(run.lengths), "zlab_tau": mean(replay.lengths),
                        "first_parting_round": parting, "batch_row": run.row, "batch": run.batch,
                        "causes": found.row["explained_by"]})
    given, printed = recording.manifest.get("tau"), recording.manifest.get("printed_tau")
    if given is None and printed is not None:  # no trace.tau: the figure the script printed last
        given = printed["value"]
        notes.append(f"the evaluator's τ read from what it printed: {printed['line']!r}")
    identity = identify(given, [run.lengths for run in runs] if temperature else their_rounds,
                        zlab_rounds, zlab_unstopped if temperature == 0 and any(
                            a != b for a, b in zip(zlab_unstopped, zlab_rounds)) else None,
                        fixed_text, ref.block_size if temperature > 0 else None)
    findings = _findings(localized, _tau_cost(their_rounds, zlab_rounds) if temperature == 0 else None,
                         {p["prompt"]: p["first_parting_round"] for p in prompts})
    if identity.given is not None and not identity.named:
        findings.append(Finding("tau", "divergence", f"the evaluator's τ {identity.value:.4g} is no τ method on its "
                                f"own rounds (nearest: {identity.nearest}); z-lab's τ is {identity.zlab:.4g}",
                                identity.value, identity.zlab, 17, "tau_method"))
    elif identity.named and not any(name.startswith("z-lab's: the mean") for name in identity.named):
        findings.append(Finding("tau", "divergence", f"the evaluator's τ {identity.value:.4g} is {identity.named[0]}, "
                                f"not z-lab's mean of per-prompt means with the bonus token; z-lab's τ on the same "
                                f"prompts is {identity.zlab:.4g} ({_signed(identity)})", identity.value,
                                identity.zlab, 17, "tau_method"))
    positions = []
    if temperature > 0:
        longest = ref.block_size - 1
        theirs, zlab = acceptance(their_drafted, longest), acceptance(zlab_drafted, longest)
        for k, gap in enumerate(position_gaps(their_drafted, zlab_drafted, longest), start=1):
            if gap is None:  # a position one side never drafted: no rate to compare
                continue
            positions.append({"position": k, "theirs": theirs[k - 1], "zlab": zlab[k - 1], "gap": gap.mean,
                              "low": gap.low, "high": gap.high, "beyond_noise": gap.beyond_noise})
        apart = [p for p in positions if p["beyond_noise"]]
        if apart:
            first = apart[0]
            findings.append(Finding("tau", "divergence", f"at temperature {temperature:g} the evaluator's acceptance "
                                    f"per draft position parts from z-lab's loop beyond noise at {len(apart)} "
                                    f"position(s), first draft {first['position']}: {first['theirs']:.3f} vs "
                                    f"{first['zlab']:.3f} (95% paired interval of the gap [{first['low']:+.3f}, "
                                    f"{first['high']:+.3f}], z-lab sampled {seeds} times)", first["theirs"],
                                    first["zlab"], 17, "acceptance_per_position"))
    tau = {"given": identity.given, "value": identity.value, "is": identity.named, "nearest": identity.nearest,
           "zlab": identity.zlab, "their_rounds": identity.their_rounds, "gap": identity.gap.mean,
           "low": identity.gap.low, "high": identity.gap.high, "beyond_noise": identity.gap.beyond_noise,
           "candidates": identity.candidates, "sentence": identity.sentence(),
           "method": identity.gap.method}
    along = _along_context(runs, all_replays, ref, drafter_path, bin_tokens)
    facts = {"recording": str(recording.folder), "drafter": {"class": entry["class"], "folder": str(drafter_path),
             "layer_ids": ref.layer_ids, "block_size": ref.block_size, "mask_token_id": ref.mask_id,
             "windows": ref.windows}, "target": {"folder": str(target_path), "stop_ids": ref.stop_ids},
             "temperature": temperature, "prompts": len(runs), "reference": "dflash 0.1.0 dflash_generate"}
    return EvaluationReport(sort_findings(findings), prompts, tau, facts, notes, positions, along)


def _signed(identity) -> str:
    gap = identity.gap
    return (f"differs by {gap.mean:+.4g}, 95% paired bootstrap interval [{gap.low:+.4g}, {gap.high:+.4g}] over "
            f"{gap.n} prompts")


def _core_assessment(recording, runs: list[PromptRun], replays, ref: Reference, localizer: EvaluatorLocalizer):
    """The evaluator as a source of rounds (its prompts, rounds and drafted blocks, its localizer) held by the one
    assessment to z-lab's loop replayed (`dflash_generate`'s rounds and blocks as a `DecodeResult` each)."""
    from dflash_audit.rounds import PromptRounds, RoundSource, assess
    from impl.decoding import DecodeResult

    script = next((a for a in recording.manifest.get("context", {}).get("argv", []) if a.endswith(".py")), "eval.py")
    source = RoundSource(Path(script).name, ref.block_size - 1, [
        PromptRounds(str(run.index), run.prompt, run.lengths, [r.block[1:] for r in run.rounds],
                     run.sequence()[len(run.prompt):]) for run in runs], localizer)
    audited = [DecodeResult(torch.tensor([replay.output]), len(run.prompt), replay.lengths,
                            {"proposals": [r.block[1:] for r in replay.rounds]}) for run, replay in zip(runs, replays)]
    return assess(source, audited)


def _along_context(runs: list[PromptRun], replays, ref: Reference, drafter_path: Path, bin_tokens: int) -> dict:
    """τ along the context (dflash_audit/tau/along_context.py), the evaluator's and z-lab's, the target's own greedy
    agreement beside them, the drafter's window, trained length (unknown: a z-lab folder records none) and rotary."""
    from dflash_audit.tau.along_context import PromptRounds, context_marks, greedy_agreement, tau_along_context
    from drafter_files.zlab_format import read_zlab_dir

    marks = context_marks(read_zlab_dir(drafter_path)[1])
    theirs = tau_along_context([PromptRounds(id=str(run.index), prompt_len=len(run.prompt), rounds=run.lengths,
                                             target_agreement=greedy_agreement(ref.target,
                                                                               torch.tensor([run.sequence()])))
                                for run in runs], marks, bin_tokens)
    zlab = tau_along_context([PromptRounds(id=str(run.index), prompt_len=len(run.prompt), rounds=replay.lengths)
                              for run, replay in zip(runs, replays)], marks, bin_tokens)
    return {"theirs": theirs.to_dict(), "zlab": zlab.to_dict(), "table": theirs.table(), "zlab_table": zlab.table()}


def _tau_cost(their: list[list[int]], zlab: list[list[int]]) -> str:
    """What the evaluator's rounds cost in τ against z-lab's loop: z-lab's method on both, the paired interval."""
    gap = paired_statistic(len(their), lambda idx: mean_of_means([their[i] for i in idx]) -
                           mean_of_means([zlab[i] for i in idx]))
    return (f"τ cost: its rounds give {mean_of_means(their):.4g} by z-lab's method against z-lab's loop "
            f"{mean_of_means(zlab):.4g}, {gap.mean:+.4g} (95% paired bootstrap interval [{gap.low:+.4g}, "
            f"{gap.high:+.4g}] over {gap.n} prompt{'s' if gap.n != 1 else ''})")


def _findings(localized: list[Finding], tau_cost: str | None = None,
              partings: dict[int, int | None] | None = None) -> list[Finding]:
    """One finding per root cause (the localizer's findings merged, as the rounds core merges them), its prompts and
    first rounds listed (an input cause may show rounds before the prompt's rounds first part: that round is said
    too); the τ cost said where one cause alone parts the rounds (it is then that cause's). The prompts come in
    order, so each merged finding's own words are its first prompt's."""
    partings = partings or {}

    def at(prompt: int, round_no: int) -> str:
        parting = partings.get(prompt)
        return f"prompt {prompt} round {round_no}" + (f" (its rounds part at round {parting})"
                                                      if parting and parting != round_no else "")

    findings = []
    for cause in merge(localized):  # the localizer's own finding (why.py's `cause_finding`), placed in words
        places = sorted(zip(cause.localized["prompts"], cause.localized["rounds"]))
        prompt, round_no = places[0]
        where = ", ".join(at(*place) for place in places[:6])
        more = f" (and {len(places) - 6} more prompts)" if len(places) > 6 else ""
        findings.append(replace(cause, message=f"{cause.message} [first at {where}{more}]",
                                raw={**cause.raw, "prompt": prompt, "round": round_no,
                                     "parting_round": partings.get(prompt)}, localized={},
                                explanation=f"first parting: prompt {prompt}, round {round_no}"))
    divergent = [f for f in findings if f.severity == "divergence"]
    if tau_cost is not None and len(divergent) == 1:
        divergent[0].message += f"; {tau_cost}"
    return findings


def write_html(report: EvaluationReport, path: Path) -> None:
    from dflash_audit.audit.report_html import environment

    html = environment().get_template("trace_evaluation.html.j2").render(report=report, data=report.to_dict())
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(html, encoding="utf-8"))


__all__ = ["EvaluationReport", "audit_evaluation", "audit_evaluation_folder", "relative", "SAME", "INPUT_CHECKS"]
