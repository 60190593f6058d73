"""Dynamic audit: both drafters on the same cached target hidden states; τ compared per prompt.

The target runs once per (target, prompts, settings) through `impl.offline`'s cache
(greedy continuation, the layers both drafters read captured on the way); each drafter's DFlash walk (one block per round)
and DDTree walk (a tree of at most `budget` nodes per round) are replayed from it, so
both drafters are judged on exactly the same target states. A drafter that cannot run against this target (missing or
non-finite tensors, a hidden size or depth the target does not have) keeps its static
findings and gets a `warning` that τ was not measured; the audit still completes.

`dynamic_audits` is the τ half of `compare` (`--target` without `--static-only`): the target, the prompts, the memory
plan, then the dynamic audit in each dtype. `compare` imports this module only then, so that a static compare never
imports the decoding loops or the target's modelling code (tests/test_start_fast.py pins what a static compare
imports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from dflash_audit.audit import tau_stats
from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.drafter_fit import misfit
from dflash_audit.audit.static_vocab import usable_d2t
from dflash_audit.offline_tau import replay_offline
from dflash_audit.progress import NoProgress, progress
from dflash_audit.tau.along_context import (
    DEFAULT_BIN_TOKENS,
    PromptRounds,
    context_marks,
    greedy_agreement,
    tau_along_context,
)
from dflash_audit.prompts import fit_prompts, load_prompts, tokenize_prompts
from dflash_audit.ranks import Ranks
from dflash_world import BUILTIN_PROMPTS
from foundation.cache_dir import cache_root
from foundation.errors import CheckpointError
from foundation.placement import (
    Placement,
    built_in,
    dtype_name,
    model_device,
    model_dtype,
    resolve_dtype,
    target_device,
)
from foundation.target import load_target_model, load_tokenizer
from foundation.target_vocab import StopIds, stop_token_ids
from impl.body_shapes import build_drafter
from impl.ddtree import DDTREE_NEEDS_DFLASH
from impl.families import TITLES
from impl.extract import decoder_layers
from impl.memory_plan import check_plan, plan_memory
from impl.offline.walks import replay_exactness
from impl.vocab_mapping import target_ids

METHODS = {"dflash": "DFlash", "ddtree": "DDTree"}
LARGEST_GAPS = 3


@dataclass
class PromptTau:
    id: str
    ours: float | None
    ref: float | None
    ours_rounds: list[int]
    ref_rounds: list[int]
    first_divergent_round: int | None


@dataclass
class MethodResult:
    method: str
    budget: int | None
    longest: dict[str, int]  # per side, the longest round: speculative tokens + 1 (B, or B + 1 sampling from the anchor)
    prompts: list[PromptTau] = field(default_factory=list)
    measured: bool = True  # both drafters ran
    along: dict[str, Any] = field(default_factory=dict)  # side -> τ along the context (tau/along_context.py)

    @property
    def label(self) -> str:
        return METHODS[self.method] + (f" (budget {self.budget})" if self.budget else "")

    @property
    def mean(self) -> dict[str, float | None]:
        return {side: (sum(getattr(p, side) for p in self.prompts) / len(self.prompts)
                       if self.prompts and all(getattr(p, side) is not None for p in self.prompts) else None)
                for side in ("ours", "ref")}

    def histogram(self, side: str) -> list[int]:
        return tau_stats.acceptance_histogram([getattr(p, f"{side}_rounds") for p in self.prompts],
                                              self.longest[side])

    def position_acceptance(self, side: str) -> list[float]:
        return tau_stats.position_acceptance([getattr(p, f"{side}_rounds") for p in self.prompts],
                                             self.longest[side])

    def interval(self) -> tau_stats.PairedInterval | None:
        if not self.measured or not self.prompts:
            return None
        return tau_stats.paired_bootstrap([p.ref - p.ours for p in self.prompts])

    def largest_gaps(self) -> list[PromptTau]:
        if not self.measured:
            return []
        return sorted(self.prompts, key=lambda p: abs(p.ref - p.ours), reverse=True)[:LARGEST_GAPS]

    def to_dict(self) -> dict[str, Any]:
        interval = self.interval()
        return {
            "method": self.method, "budget": self.budget, "measured": self.measured,
            "prompts": [vars(p) for p in self.prompts], "mean": self.mean,
            "histogram": {s: self.histogram(s) for s in ("ours", "ref")} if self.measured else None,
            "position_acceptance": ({s: self.position_acceptance(s) for s in ("ours", "ref")}
                                    if self.measured else None),
            "largest_gaps": [p.id for p in self.largest_gaps()],
            "interval": vars(interval) | {"beyond_noise": interval.beyond_noise} if interval else None,
            "along_context": {side: along.to_dict() for side, along in self.along.items()},
        }


@dataclass
class DynamicAudit:
    methods: dict[str, MethodResult]
    findings: list[Finding]
    max_new_tokens: int
    prompts_source: str
    not_measured: dict[str, str] = field(default_factory=dict)  # side -> why
    precision: dict[str, Any] = field(default_factory=dict)  # device, target and drafter dtypes
    overflow: dict[str, str] = field(default_factory=dict)  # side -> first module with non-finite output
    by_dtype: dict[str, dict[str, Any]] = field(default_factory=dict)  # `compare --dtype a,b`: τ per dtype
    # A reduced draft vocabulary on either side: the share of the target's generated tokens each side can propose.
    proposable_share: dict[str, dict[str, Any]] | None = None
    stops: StopIds = field(default_factory=lambda: StopIds([], {}))  # where the target's passes stop

    def summary(self) -> dict[str, Any]:
        """Mean τ per method and side, and what overflowed: one dtype's line of `by_dtype`."""
        return {"means": {name: result.mean for name, result in self.methods.items()},
                "overflow": self.overflow, "precision": self.precision}

    def tau_dict(self) -> dict[str, Any]:
        """`tau` of report.json: the DFlash result in the schema's shape, DDTree as an extra key."""
        main = self.methods["dflash"].to_dict()
        data = {"method": "dflash", "prompts": main["prompts"], "mean": main["mean"],
                "max_new_tokens": self.max_new_tokens, **self.stops.report(), "prompts_source": self.prompts_source,
                "noise": tau_stats.NOISE_METHOD, "not_measured": self.not_measured,
                "precision": self.precision, "overflow": self.overflow, "by_dtype": self.by_dtype,
                "draft_vocab_share": self.proposable_share}
        data.update({k: v for k, v in main.items() if k not in data and k != "method"})
        data["methods"] = {name: result.to_dict() for name, result in self.methods.items()}
        return data


# -- running ---------------------------------------------------------------------------------
class OverflowWatch:
    """Non-finite activations of a drafter while it runs: fc fusion overflowing float16 is the known case.

    Forward hooks on every submodule keep one flag each, on the drafter's device, and never synchronise while the
    drafter runs; the flags are read once at the end. The culprit is the first module, in the order they ran, whose
    output was ever non-finite: the ones after it only inherit its inf or NaN."""

    def __init__(self, model: nn.Module):
        device = model_device(model)
        modules = [(name, module) for name, module in model.named_modules() if name]
        self.flags = {name: torch.zeros((), dtype=torch.bool, device=device) for name, _ in modules}
        self.order: dict[str, None] = {}  # module names in the order they first ran
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in modules]

    def _hook(self, name: str):
        flag = self.flags[name]

        def check(_module, _inputs, output):
            self.order.setdefault(name)
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                flag.logical_or_(~torch.isfinite(out).all())
        return check

    def close(self) -> str | None:
        """Remove the hooks; the first module (in the order they ran) whose output was ever non-finite, or None."""
        for handle in self.handles:
            handle.remove()
        return next((name for name in self.order if bool(self.flags[name])), None)


def why_not_runnable(side: Side, target) -> str | None:
    """A reason this drafter cannot run against `target`, or None."""
    why = misfit(side, target.config.hidden_size, len(decoder_layers(target)), target.config.vocab_size)
    if why is not None:
        return why
    bad = [k for k, t in side.state_dict.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        return f"non-finite values in {bad[0]}"
    try:
        build_drafter(side.spec, side.state_dict, source=side.path)
    except CheckpointError as exc:
        return str(exc)
    return None


@torch.inference_mode()
def dynamic_audit(ours: Side, ref: Side, target_dir: str | Path, target, tokenizer,
                  prompts: list[tuple[str, torch.Tensor]], prompts_source: str, max_new_tokens: int = 64,
                  budget: int = 32, cache_dir: str | Path | None = None, progress=None,
                  ranks: Ranks | None = None, bin_tokens: int = DEFAULT_BIN_TOKENS) -> DynamicAudit:
    """τ of both drafters on `prompts` ([(id, input_ids [1, T])]), replayed offline on one hidden-state cache.

    `progress` (dflash_audit.progress) counts the tokens of every pass over a prompt: the target's cache
    build (nothing when the cache is found), then each drafter's replay per method (`progress_passes`).
    Under torchrun (`ranks`) rank 0 builds the cache (the others then read it), each rank replays its
    share of the prompts, and every rank gets all results back. `bin_tokens`: τ along the context's bin width.
    """
    ranks = ranks or Ranks.single()
    progress = progress or NoProgress()
    sides = {"ours": ours, "ref": ref}
    not_measured = {name: why for name, side in sides.items() if (why := why_not_runnable(side, target))}
    # The drafters run where the target reads its inputs, in the target's dtype: their serving dtype.
    device, dtype = target_device(target), model_dtype(target)
    drafters = {name: built_in(device, dtype, lambda side=side: build_drafter(side.spec, side.state_dict)).eval()
                for name, side in sides.items() if name not in not_measured}
    watches = {name: OverflowWatch(drafter) for name, drafter in drafters.items()}
    plan = methods_for(sides, budget)
    mine = len(ranks.shard(prompts))
    built = []  # the new tokens of each prompt the target generated (none when the cache was found)

    def skip_unrun(_cache) -> None:
        progress.skip(len(prompts) - len(built))  # the target's passes over cached prompts
        # Passes this rank does not run: another rank's prompts, a drafter that cannot run.
        progress.skip(len(plan) * (len(drafters) * (len(prompts) - mine) + len(not_measured) * len(prompts)))

    stops = stop_token_ids(target_dir, tokenizer)
    run = replay_offline(drafters, target, target_dir, prompts, max_new_tokens, stops.ids, plan,
                         cache_dir or cache_root() / "offline", ranks, progress,
                         on_prompt=lambda tokens: (built.append(tokens), progress.advance(tokens)),
                         on_cache=skip_unrun,
                         also_gather=lambda: [{"overflow": name, "module": module} for name, watch in watches.items()
                                              if (module := watch.close()) is not None])
    cache, replays = run.cache, run.rounds
    overflow: dict[str, str] = {}
    for record in run.gathered:  # the lowest rank's culprit when several ranks saw one
        overflow.setdefault(record["overflow"], record["module"])
    methods = {}
    dflash2 = dflash2_sides(sides)
    # τ along the context: each side's rounds by position, beside the target's own greedy agreement on the prompts.
    agreement = [greedy_agreement(target, entry.token_ids[: entry.prompt_len][None]) for entry in cache.prompts]
    marks = {name: context_marks(side.spec, side.recipe, side.recipe_unknown) for name, side in sides.items()
             if side.spec is not None}
    for method, method_budget in plan:
        result = MethodResult(method, method_budget, {n: s.spec.longest_round for n, s in sides.items()},
                              measured=not not_measured)
        for i, entry in enumerate(cache.prompts):
            rounds = {name: replays[method, name, i] for name in drafters}
            o, r = rounds.get("ours", []), rounds.get("ref", [])
            result.prompts.append(PromptTau(
                entry.id, tau_stats.tau(o) if "ours" in rounds else None,
                tau_stats.tau(r) if "ref" in rounds else None, o, r,
                tau_stats.first_divergent_round(o, r) if len(rounds) == 2 else None))
        result.along = {name: tau_along_context([PromptRounds(id=entry.id, prompt_len=entry.prompt_len,
                                                              rounds=replays[method, name, i],
                                                              target_agreement=agreement[i])
                                                 for i, entry in enumerate(cache.prompts)], marks.get(name),
                                                bin_tokens)
                        for name in drafters}
        methods[method] = result
    findings = [Finding("tau", "warning", f"τ of {name} was not measured: {why}. Its static findings stand.",
                        why if name == "ours" else None, why if name == "ref" else None, pitfall=17,
                        key=f"not measured ({name})")
                for name, why in not_measured.items()]
    findings += [f for result in methods.values() if (f := tau_finding(result))]
    if dflash2:
        which = " and ".join(f"{name} is a {TITLES[sides[name].spec.family]} drafter" for name in dflash2)
        findings.append(Finding("tau", "info", f"DDTree τ not measured: {which}. "
                                f"{DDTREE_NEEDS_DFLASH}.", None, None, pitfall=17, key="ddtree not measured"))
    # A drafter that overflows in a dtype cannot be served in it (fc fusion in float16 is the known case): a
    # divergence, in whichever dtype of `compare --dtype` it happens.
    findings += [Finding("tau", "divergence", f"{name} overflows in {dtype_name(dtype)}: {module} produced non-finite "
                         f"activations, so its τ in {dtype_name(dtype)} is not what it was trained to give.",
                         module if name == "ours" else None, module if name == "ref" else None, pitfall=17,
                         key=f"overflow ({name}, {dtype_name(dtype)})")
                 for name, module in overflow.items()]
    precision = {"device": str(device), "target_dtype": dtype_name(dtype), "drafter_dtype": dtype_name(dtype)}
    if (exactness := replay_exactness(dtype)) is not None:
        precision["offline_exactness"] = exactness
    if run.engine is not None:  # `--hidden-states vllm`: the cache's states came from that engine
        precision["hidden_states"] = run.engine
    return DynamicAudit(methods, findings, max_new_tokens, prompts_source, not_measured, precision, overflow,
                        proposable_share=proposable_share(sides, cache.prompts), stops=stops)


def proposable_share(sides: dict[str, Side], entries) -> dict[str, dict[str, Any]] | None:
    """With a reduced draft vocabulary on either side: the share of the target's own tokens on the prompts (its
    greedy continuations) that each side's head can propose at all (a token outside it is never drafted). None
    when both heads cover the whole vocabulary."""
    vocabularies = {name: usable_d2t(side) for name, side in sides.items()}
    if all(v is None for v in vocabularies.values()):
        return None
    generated = torch.cat([entry.token_ids[entry.prompt_len:] for entry in entries]).long()
    shares = {}
    for name, d2t in vocabularies.items():
        held = torch.ones_like(generated, dtype=torch.bool) if d2t is None else \
            torch.isin(generated, target_ids(d2t).to(generated.device))
        shares[name] = {"share": round(float(held.float().mean()), 6) if generated.numel() else None,
                        "tokens": int(generated.numel())}
    return shares


def attach_proposable_share(findings: list[Finding], shares: dict[str, dict[str, Any]] | None) -> None:
    """The dynamic half of a static `draft_vocab` finding: how much of the target's output each side can propose
    (part of that finding's root cause, never a finding of its own)."""
    if not shares or any(v["share"] is None for v in shares.values()):
        return
    text = {name: f"{100 * v['share']:.1f}%" for name, v in shares.items()}
    for finding in findings:
        if finding.component == "draft_vocab" and "proposable_share" not in finding.raw:
            finding.message += (f" On the prompts, ours can propose {text['ours']} and ref {text['ref']} of the "
                                f"target's {shares['ours']['tokens']} generated tokens.")
            finding.raw["proposable_share"] = shares


def progress_passes(ours: Side, ref: Side, budget: int) -> int:
    """The passes `dynamic_audit` makes over each prompt: the target's, then each drafter's per method."""
    return 1 + 2 * len(methods_for({"ours": ours, "ref": ref}, budget))


def dtype_findings(audits: dict[str, DynamicAudit]) -> list[Finding]:
    """`compare --dtype a,b`: a drafter whose DFlash τ drops beyond noise in a dtype, against the best
    dtype it was measured in (per prompt, paired bootstrap). An overflow is already the finding of its run,
    and its τ drop in that dtype is the same root cause: not a second finding."""
    findings = []
    for side in ("ours", "ref"):
        measured = {name: audit.methods["dflash"] for name, audit in audits.items()
                    if audit.methods["dflash"].mean[side] is not None}
        overflowed = {name for name, audit in audits.items() if side in audit.overflow}
        if len(measured) < 2:
            continue
        best = max(measured, key=lambda name: measured[name].mean[side])
        for name, result in measured.items():
            if name == best or name in overflowed:
                continue
            gaps = [getattr(a, side) - getattr(b, side) for a, b in zip(result.prompts, measured[best].prompts)]
            interval = tau_stats.paired_bootstrap(gaps)
            if interval.beyond_noise and interval.mean < 0:
                findings.append(Finding(
                    "tau", "warning", f"τ of {side} drops in {name}: mean {result.mean[side]:.3f} against "
                    f"{measured[best].mean[side]:.3f} in {best}; the difference {interval.mean:+.3f} "
                    f"[{interval.low:+.3f}, {interval.high:+.3f}] (95%, paired bootstrap) excludes 0.",
                    result.mean[side] if side == "ours" else None, result.mean[side] if side == "ref" else None,
                    pitfall=17, key=f"dtype drop ({side}, {name})"))
    return findings


def dflash2_sides(sides: dict[str, Side]) -> list[str]:
    """The sides DDTree cannot run on: every family but DFlash (each slot depends on the tokens chosen before it)."""
    return [name for name, side in sides.items() if side.spec is not None and side.spec.family != "dflash"]


def methods_for(sides: dict[str, Side], budget: int) -> list[tuple[str, int | None]]:
    """DFlash, and DDTree unless a drafter is DFlash2: DDTree builds its tree from independent
    per-slot marginals, and a DFlash2 drafter's selector has none."""
    return [("dflash", None)] + ([] if dflash2_sides(sides) else [("ddtree", budget)])


def tau_finding(result: MethodResult) -> Finding | None:
    interval = result.interval()
    if interval is None:
        return None
    mean = result.mean
    span = f"{interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]"
    if interval.beyond_noise:
        better = "ref" if interval.mean > 0 else "ours"
        return Finding(
            "tau", "divergence",
            f"{result.label}: mean τ {mean['ours']:.3f} for ours vs {mean['ref']:.3f} for ref over "
            f"{interval.n} prompts; τ_ref − τ_ours = {span} (95%, paired bootstrap) excludes 0, so {better} "
            "accepts more tokens per round beyond noise.", mean["ours"], mean["ref"], pitfall=17,
            key=result.method)
    return Finding(
        "tau", "info",
        f"{result.label}: mean τ {mean['ours']:.3f} for ours vs {mean['ref']:.3f} for ref; τ_ref − τ_ours = {span} "
        "(95%, paired bootstrap) is within noise.", mean["ours"], mean["ref"], pitfall=17, key=result.method)


def load_prompt_ids(prompts_file: Path | None, tokenizer, chat=None) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """[(id, input_ids)] from a prompts file (JSON lines) or the built-in coding prompts, rendered by `chat`
    (a `ChatTemplate`; None: the tokenizer's own template when it has one)."""
    if prompts_file is None:
        prompts, source = BUILTIN_PROMPTS, "built-in"
    else:
        prompts, source = load_prompts(prompts_file), str(prompts_file)
    return tokenize_prompts(tokenizer, prompts, chat if chat is not None else "auto"), source


def dynamic_audits(ours_side, ref_side, target: Path, prompts: Path | None, max_new_tokens: int, budget: int,
                   cache_dir: Path | None, console: Console, truncate: bool, placement: Placement,
                   dtypes: list[str | None], notes: list[str], ranks: Ranks, chat=None,
                   bin_tokens: int = DEFAULT_BIN_TOKENS):
    """The τ audit in each dtype (None: the placement's own), after a memory plan that fits; the first
    dtype's audit carries every dtype's summary and the findings of a drop between them."""
    tokenizer, config = load_tokenizer(target)
    if chat is not None:  # recorded in the report: the template and its kwargs move τ as much as a bug
        chat.check_kwargs(tokenizer)
        notes.append(f"chat template: {json.dumps(chat.describe(tokenizer))}")
    prompt_list, source = load_prompt_ids(prompts, tokenizer, chat)
    prompt_list, fit_notes = fit_prompts(prompt_list, max_new_tokens, config.max_position_embeddings, truncate,
                                         source)
    notes.extend(fit_notes)
    runs = [placement if name is None else placement.with_dtype(*resolve_dtype(name, target)) for name in dtypes]
    audits = {}
    for run in runs:
        check_plan(plan_memory(config, run.dtype, [ours_side.spec, ref_side.spec],
                               [ids.shape[1] for _, ids in prompt_list], max_new_tokens), run)
        target_model = load_target_model(target, run)
        # In tokens: the target's pass over each prompt (none when cached), then each drafter's per method.
        with progress(console, f"dynamic audit ({run.describe()['dtype']})", len(prompt_list), max_new_tokens,
                      progress_passes(ours_side, ref_side, budget), enabled=ranks.rank == 0) as bar:
            audit = dynamic_audit(ours_side, ref_side, target, target_model, tokenizer, prompt_list, source,
                                  max_new_tokens, budget, cache_dir, progress=bar, ranks=ranks,
                                  bin_tokens=bin_tokens)
        audit.precision.update({k: v for k, v in run.describe().items() if k not in ("dtype", "device")})
        audits[audit.precision["target_dtype"]] = audit
        del target_model  # one target in memory at a time
    main = next(iter(audits.values()))
    if len(audits) > 1:
        main.by_dtype = {name: audit.summary() for name, audit in audits.items()}
        main.findings += [f for audit in list(audits.values())[1:] for f in audit.findings
                          if f.key.startswith("overflow")]
        main.findings += dtype_findings(audits)
    return main
