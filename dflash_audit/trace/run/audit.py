"""The run across steps (`trace --steps N`, N >= 2), held to speculators' TrainConfig-resolved run for the family
found (reference_adapters/speculators_run_recipe.py, every value with its file and line): the optimizers and their
groups, the peak lr, the schedule's warmup and decay (fitted by value, lr_fit.py), clipping, accumulation, precision,
resume and the ranks' shards, each a `recipe` finding; a loss that does not move, gradients that are zero or
parameters that never change, each a `loss` finding. One root cause is one finding.

A one-step recording is not a run: its facts are kept, and a note says the run needs `--steps N` with N >= 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from catalogue.findings import Finding
from dflash_audit.trace.run.lr_fit import fit_schedule, schedule_text

RUN_ENTRY = 40  # the catalogue's training_run entry
# The run's findings, by (component, key); their `source` is the speculators file and line they rest on.
RUN_KEYS = {("recipe", k) for k in ("optimizer", "optimizer_settings", "lr", "lr_schedule", "lr_warmup", "grad_clip",
                                    "accumulation", "precision", "resume", "shard", "untrained_params",
                                    "step_parity")} | \
    {("loss", k) for k in ("zero_gradients", "no_update", "not_moving", "not_finite")}
FAMILIES = (("DFlash2", "dflash2"), ("DSpark", "dspark"), ("XPress", "xpress"))


@dataclass
class RunAudit:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, component: str, key: str, message: str, ours, ref, source: str,
            severity: str = "divergence") -> None:
        assert (component, key) in RUN_KEYS, (component, key)
        if any((f.component, f.key) == (component, key) for f in self.findings):
            return
        self.findings.append(run_finding(component, key, message, ours, ref, source, severity))


def run_finding(component: str, key: str, message: str, ours, ref, source: str, severity: str) -> Finding:
    """One finding of the run, under the catalogue's training_run entry."""
    return Finding(component, severity, message, ours, ref, pitfall=RUN_ENTRY, key=key, source=source)


def family_of(drafter_class: str) -> str:
    """The family the drafter's class names (speculators' classes and ours are named after it); else DFlash."""
    name = drafter_class.rsplit(":", 1)[-1]
    return next((family for word, family in FAMILIES if word.lower() in name.lower()), "dflash")


def short(class_name: str) -> str:
    return class_name.rsplit(":", 1)[-1]


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def audit_run(manifest: dict, folder=None, step_findings: list[Finding] | None = None) -> RunAudit:
    """The run across the recorded steps; `step_findings`: the step audit's (audit.py), which explain a step parity
    parted in the forward or the loss."""
    from reference_adapters.speculators_run_recipe import reference_title, run_reference

    result = RunAudit()
    run = (manifest.get("context") or {}).get("run") or {}
    steps = run.get("steps") or []
    structure = run.get("structure") or {}
    if not steps or not structure:
        result.notes.append("the run: no optimizer step was seen, so nothing across steps is known")
        return result
    family = family_of(manifest["steps"][0]["drafter"]["class"])
    title = reference_title(family)
    result.facts = {"reference": title, "family": family, "steps": len(steps), "per_step": per_step(steps)}
    shards(result, steps)  # each step's ranks on their own: one step under torchrun says it
    if len(steps) < 2:
        result.notes.append(f"the run: one optimizer step recorded; the optimizers, schedule, clipping and loss across "
                            f"steps are audited from two (trace --steps N, N >= 2), held to {title}")
        return result
    ref = run_reference(family)
    lr_zero = optimizers(result, structure, steps, ref)
    schedule(result, steps, ref)
    clipping(result, steps, ref)
    accumulation(result, steps, ref)
    precision(result, steps, ref)
    resume(result, steps, ref)
    loss(result, steps, lr_zero, structure.get("not_in_any_optimizer") or [])
    if folder is not None and run.get("parity"):
        parity(result, folder, run, ref, [f for f in step_findings or [] if f.severity == "divergence"])
    return result


def parity(result: RunAudit, folder, run: dict, ref, step_divergences: list[Finding]) -> None:
    """speculators' reference step beside the recorded steps (run/parity.py): where they part is a fact of the findings
    above (a forward or a loss parted: of the step audit's divergences too); parting with no finding to explain it is
    its own warning."""
    from dflash_audit.trace.run.parity import step_parity

    if run["parity"].get("unavailable"):  # the run's tensors could not be kept whole (recorder.py)
        result.notes.append(f"step parity: not compared: {run['parity']['unavailable']}")
        return
    found = step_parity(folder, run, ref, result.facts.get("schedule"))
    result.facts["parity"] = found
    parted = found.get("parted")
    if not parted:
        if found.get("compared"):
            tolerance = found["tolerance"]
            ran = str(found.get("forward", ""))
            forward = f"draft logits and loss within {tolerance['loss']:g}, " if ran.startswith("speculators'") else ""
            result.notes.append(f"step parity: the first {found['compared']} steps match speculators' reference step "
                                f"({forward}gradient within {tolerance['gradient']:g}, AdamW update within "
                                f"{tolerance['adamw_update']:g}, Muon update within {tolerance['muon_update']:g} of "
                                "its size)")
            if ran and not ran.startswith("speculators'"):
                result.notes.append(f"step parity: the forward and the loss {ran}")
        return
    text = (f"step parity: the run parts from speculators' reference step at step {parted['step']}, in the "
            f"{parted['phase']} ({parted['parameter']}: {parted['what']})")
    if result.findings or (parted["phase"] in ("forward", "loss") and step_divergences):
        result.notes.append(text)
    else:
        result.add("recipe", "step_parity", text + "; no finding above explains it", parted["phase"], "parity",
                   "speculators/train/optimizers.py: build_optimizers; speculators/train/trainer.py:551",
                   severity="warning")


def per_step(steps: list[dict]) -> list[dict]:
    rows = []
    for i, s in enumerate(steps):
        rows.append({"step": i + 1, "loss": s.get("loss"), "lr": [lrs[0] if lrs else None for lrs in s["lrs"]],
                     "grad_norm_after_backward": s.get("grad_norm_after_backward"),
                     "grad_norm_at_step": s.get("grad_norm_at_step"), "backwards": s.get("backwards"),
                     "params_moved": s.get("params_moved")})
    return rows


# -- the optimizers --------------------------------------------------------------------------------------------------
def optimizers(result: RunAudit, structure: dict, steps: list[dict], ref) -> bool:
    """Which optimizer trains each parameter, their settings and base lrs; True when every base lr is 0."""
    found = structure["optimizers"]
    result.facts["optimizers"] = [{"class": o["class"], "groups": [{**g["settings"], "params": len(g["params"])}
                                                                  for g in o["groups"]]} for o in found]
    expected = {"muon": "Muon", "adamw": "AdamW"}
    wrong, by_class, params = [], {}, 0
    for o in found:
        name = short(o["class"])
        for g in o["groups"]:
            for p in g["params"]:
                params += 1
                by_class[name] = by_class.get(name, 0) + 1
                want = expected[ref.group_of(p["name"], p["shape"])]
                if name != want:
                    wrong.append((p["name"], name, want))
    want_counts: dict[str, int] = {}
    for o in found:
        for g in o["groups"]:
            for p in g["params"]:
                key = expected[ref.group_of(p["name"], p["shape"])]
                want_counts[key] = want_counts.get(key, 0) + 1
    source = f"{ref.sources['optimizer']}, {ref.sources['split']}, {ref.sources['build_optimizers']}"
    if wrong:
        ours = " + ".join(f"{c} on {n} parameter{'s' if n != 1 else ''}" for c, n in by_class.items())
        theirs = " + ".join(f"{c} on {n}" for c, n in want_counts.items())
        muon = f"Muon ({ref.settings_text('muon')}) on the 2-D weight matrices" if ref.optimizer == "muon" else ""
        result.add("recipe", "optimizer", f"optimizer: {ours}; {ref.title} trains {theirs}: {muon}"
                   f"{' plus ' if muon else ''}AdamW ({ref.settings_text('adamw')}) on the rest — {len(wrong)} "
                   f"parameters (e.g. {wrong[0][0]}) get another optimizer's update", ours, theirs, source)
    # The settings of each group whose optimizer is the reference's own for its parameters.
    differ, lrs, all_zero = [], [], True
    for oi, o in enumerate(found):
        name = short(o["class"])
        kind = next((k for k, v in expected.items() if v == name), None)
        for gi, g in enumerate(o["groups"]):
            base = base_lr(g["settings"], steps, oi, gi)
            if base is None or base != 0:
                all_zero = False
            if kind is None:
                continue
            want = ref.muon if kind == "muon" else ref.adamw
            if base is not None and not _close(base, want["lr"]):
                lrs.append((f"{name} group {gi}", base, want["lr"]))
            for setting, value in want.items():
                if setting == "lr":
                    continue
                got = g["settings"].get(setting)
                if got is None:
                    continue
                same = [_close(float(a), float(b)) for a, b in zip(got, value)] if isinstance(value, tuple) else \
                    [got == value if isinstance(value, (str, bool)) else _close(float(got), float(value))]
                if not all(same):
                    differ.append((f"{name} {setting}", got, list(value) if isinstance(value, tuple) else value))
    if lrs:
        text = "; ".join(f"{where} {got:g} vs {want:g}" for where, got, want in lrs)
        # Every base lr 0: no step changes a weight, so the loss cannot train; that is this one cause, said here.
        still = ": at lr 0 no optimizer step changes a weight, so the drafter does not train" if all_zero and found \
            else ""
        result.add("recipe", "lr", f"lr (the base the schedule scales): {text} in {ref.title}{still}", lrs[0][1],
                   lrs[0][2], f"{ref.sources['lr']}, {ref.sources['muon_lr']}")
    if differ:
        text = "; ".join(f"{where} {got} vs {want}" for where, got, want in differ)
        result.add("recipe", "optimizer_settings", f"optimizer settings: {text} in {ref.title}", differ[0][1],
                   differ[0][2], f"{ref.sources['adamw_defaults']}; {ref.sources['muon_defaults']}; "
                                 f"{ref.sources['muon_momentum']}")
    missing = structure.get("not_in_any_optimizer") or []
    if missing and not all(s["params_with_grad"] == 0 for s in steps):  # else one cause: loss.zero_gradients
        result.add("recipe", "untrained_params", f"{len(missing)} trainable parameters of the drafter are in no "
                   f"optimizer (e.g. {missing[0]}): they get gradients but never change", len(missing), 0,
                   ref.sources["build_optimizers"], severity="warning")
    return all_zero and bool(found)


def base_lr(settings: dict, steps: list[dict], optimizer: int, group: int) -> float | None:
    """The lr the schedule scales: the group's `initial_lr` (set by a torch scheduler), else the lr when it never
    changes, else unknown."""
    initial = settings.get("initial_lr")
    if initial is not None:
        return float(initial)
    seen = [s["lrs"][optimizer][group] for s in steps if optimizer < len(s["lrs"]) and group < len(s["lrs"][optimizer])]
    if seen and all(v == seen[0] for v in seen):
        return float(seen[0])
    return None


# -- the schedule ----------------------------------------------------------------------------------------------------
def schedule(result: RunAudit, steps: list[dict], ref) -> None:
    first = steps[0]
    if not first["lrs"] or not first["lrs"][0]:
        return
    base = first["initial_lrs"][0][0] if first["initial_lrs"] and first["initial_lrs"][0] else None
    lrs = [s["lrs"][0][0] for s in steps]
    if base is None:
        base = lrs[0] if all(v == lrs[0] for v in lrs) else None
    if base == 0:
        result.notes.append("the lr schedule: the base lr is 0, so there is no schedule to fit")
        return
    if not base:
        result.notes.append("the lr schedule: the base lr is not known (no torch scheduler set initial_lr and the lr "
                            "changes), so its warmup and decay are not fitted")
        return
    declared = next((d for sched in first.get("schedulers", []) for d in sched.get("declared", [])), None)
    fit = fit_schedule([v / base for v in lrs], declared)
    result.facts["schedule"] = {**fit, "text": schedule_text(fit), "base_lr": base}
    groups = {tuple(round(v / b, 9) for v in vals) for vals, b in group_factors(steps) if b}
    if len(groups) > 1:
        result.notes.append("the lr schedule: the groups follow different schedules; the first group's is fitted")
    source = f"{ref.sources['scheduler_type']}, {ref.sources['schedule']}"
    wanted = f"linear warmup over 1/{ref.warmup_divisor} of the total ({ref.sources['warmup']}), then linear decay to 0"
    if fit["shape"] not in (None, ref.schedule) and ref.schedule == "linear":
        result.add("recipe", "lr_schedule", f"lr schedule: {schedule_text(fit)}; {ref.title}: {wanted}",
                   fit["shape"], ref.schedule, source)
    n = len(steps)
    if fit["warmup"] is not None and fit["total"] is not None and fit["shape"] in ("linear", None, "cosine"):
        want = ref.warmup_for(fit["total"])
        if fit["warmup"] != want:
            result.add("recipe", "lr_warmup", f"warmup: {fit['warmup']} steps over a total of {fit['total']} "
                       f"(from {fit['total_from']}); {ref.title} warms up for total // {ref.warmup_divisor} = {want}",
                       fit["warmup"], want, ref.sources["warmup"])
    elif fit["warmup"] is not None and fit["shape"] != "constant":
        divisor = ref.warmup_divisor or 1
        low = fit["warmup"] * divisor
        result.notes.append(f"the lr schedule: warmup {fit['warmup']} steps, the total not seen in {n} steps "
                            f"({'; '.join(fit['unknown']) or 'no decay'}); speculators' rule (total // {divisor}) "
                            f"gives {fit['warmup']} for a total of {low}..{low + divisor - 1}: not held to it")
        return
    for reason in fit["unknown"]:
        result.notes.append(f"the lr schedule: {reason}")
    divisor = ref.warmup_divisor or 1
    if fit["total"] is not None and fit["total"] < divisor:
        result.notes.append(f"the lr schedule: speculators warms up for total // {divisor} steps, none for this "
                            f"run's total of {fit['total']}: no warmup is sound here")
    elif fit["total"] is None and fit["shape"] != "constant":
        result.notes.append(f"the lr schedule: speculators warms up for total // {divisor} steps (none under "
                            f"{divisor}); this run's total is not seen in its {n} recorded steps, so its warmup is "
                            "not held to it")


def group_factors(steps: list[dict]):
    for oi, lrs in enumerate(steps[0]["lrs"]):
        for gi, _ in enumerate(lrs):
            vals = [s["lrs"][oi][gi] for s in steps]
            base = steps[0]["initial_lrs"][oi][gi] or (vals[0] if all(v == vals[0] for v in vals) else None)
            yield vals, base


# -- clipping, accumulation, precision -------------------------------------------------------------------------------
def clipping(result: RunAudit, steps: list[dict], ref) -> None:
    limit, source = ref.clip_max_norm, ref.sources["clip"]
    calls = [c for s in steps for c in s["clip_calls"]]
    pairs = [(i + 1, s["grad_norm_after_backward"], s["grad_norm_at_step"]) for i, s in enumerate(steps)
             if s["grad_norm_after_backward"] is not None and s["grad_norm_at_step"] is not None]
    # The clipped norm is recomputed in the gradients' dtype: a few of its roundings apart from the limit.
    grads = {d for s in steps for d in s["dtypes"]["grads"]}
    slack = 1e-4 if grads <= {"float32", "float64"} else 2e-2
    over = [(k, a, b) for k, a, b in pairs if b > limit * (1 + slack)]
    if calls:
        norms = sorted({c["max_norm"] for c in calls})
        if any(not _close(m, limit) for m in norms) or any(c["norm_type"] != ref.clip_norm_type for c in calls):
            result.add("recipe", "grad_clip", f"gradient clipping: clip_grad_norm_ at max_norm {norms[0]:g} "
                       f"(norm type {calls[0]['norm_type']:g}); {ref.title} clips at {limit:g} (norm "
                       f"{ref.clip_norm_type:g})", norms[0], limit, source)
        elif over:
            k, a, b = over[0]
            result.add("recipe", "grad_clip", f"gradient clipping: clip_grad_norm_({limit:g}) is called, but the "
                       f"gradient the optimizer stepped at step {k} has norm {b:.4g} (not the gradient clipped?); "
                       f"{ref.title} steps a gradient clipped to {limit:g}", b, limit, source)
        return
    clipped = [(k, a, b) for k, a, b in pairs if b < a * (1 - 1e-6)]
    if clipped:
        bounds = sorted({round(b, 6) for _, _, b in clipped})
        if any(not _close(b, limit, 1e-4) for b in bounds):
            result.add("recipe", "grad_clip", f"gradient clipping: the gradient is cut to norm {bounds[0]:.4g} "
                       f"(no clip_grad_norm_ call seen; by value at step {clipped[0][0]}); {ref.title} clips at "
                       f"{limit:g}", bounds[0], limit, source)
        return
    if over:
        k, a, b = over[0]
        result.add("recipe", "grad_clip", f"no gradient clipping: the gradient's norm was {a:.4g} at step {k} and "
                   f"was stepped as it was; {ref.title} clips it to {limit:g}", None, limit, source)
    elif pairs:
        top = max(a for _, a, _ in pairs)
        result.notes.append(f"clipping: no clip_grad_norm_ call was seen and the gradient's norm never exceeded "
                            f"{limit:g} (at most {top:.4g}): clipping at {limit:g} would not have changed these "
                            f"{len(steps)} steps, so whether the trainer clips cannot be told")


def accumulation(result: RunAudit, steps: list[dict], ref) -> None:
    counts = sorted({s["backwards"] for s in steps})
    result.facts["backwards_per_step"] = counts
    if counts != [ref.backwards_per_step]:
        result.add("recipe", "accumulation", f"gradient accumulation: {', '.join(map(str, counts))} backwards per "
                   f"optimizer step; {ref.title} runs {ref.backwards_per_step} (its effective batch is one loader "
                   "batch)", counts[-1], ref.backwards_per_step, ref.sources["backwards"], severity="warning")


def precision(result: RunAudit, steps: list[dict], ref) -> None:
    params = sorted({d for s in steps for d in s["dtypes"]["params"]})
    grads = sorted({d for s in steps for d in s["dtypes"]["grads"]})
    state = sorted({d for s in steps for d in s["dtypes"]["optimizer_state"]})
    autocast = sorted({tuple(a) for s in steps for a in s["autocast"]}, key=str)
    compute = sorted({a[2] if a[1] else "no autocast" for a in autocast})
    result.facts["precision"] = {"params": params, "grads": grads, "optimizer_state": state, "autocast": compute}
    source = f"{ref.sources['hidden_states_dtype']}, {ref.sources['autocast']}"
    if params and params != [ref.master_dtype]:
        result.add("recipe", "precision", f"mixed precision: the parameters the optimizer steps (the master weights) "
                   f"are {', '.join(params)}; {ref.title} keeps them in {ref.master_dtype} and autocasts the compute "
                   f"to {ref.autocast_dtype} — updates below the weights' resolution are lost", params[0],
                   ref.master_dtype, source)
    elif "float16" in compute:
        result.add("recipe", "precision", f"mixed precision: the drafter's forward autocasts to float16, which "
                   f"speculators refuses (it needs gradient scaling); {ref.title} autocasts to {ref.autocast_dtype}",
                   "float16", ref.autocast_dtype, source)
    elif compute and compute != [ref.autocast_dtype]:
        result.notes.append(f"precision: the drafter's forward ran with {', '.join(compute)} (master weights "
                            f"{', '.join(params)}); speculators autocasts to {ref.autocast_dtype} on an accelerator "
                            f"({ref.sources['autocast']}): float32 compute is its exact form, not a divergence")


def resume(result: RunAudit, steps: list[dict], ref) -> None:
    first = steps[0]
    optimizer_step = max(first.get("optimizer_state_steps") or [0])
    has_state = any(first.get("optimizer_states") or [optimizer_step > 0])
    epochs = [s["last_epoch"] for s in first.get("schedulers", [])]
    loaded = first.get("loaded") or {}
    result.facts["resume"] = {"optimizer_state_step": optimizer_step, "optimizer_has_state": has_state,
                              "scheduler_last_epoch": epochs, "loaded": loaded}
    source = "speculators/train/trainer.py: Trainer.setup_optimizer (load_optimizer_state_dict, " \
             "load_scheduler_state_dict)"
    if has_state and epochs and all(e == 0 for e in epochs):
        result.add("recipe", "resume", f"resume: the optimizer's state is carried over (at step {optimizer_step}) but "
                   "the scheduler starts over at step 0 — the lr restarts its warmup and decay; speculators restores "
                   "both from the checkpoint", 0, optimizer_step, source)
    elif not has_state and any(e > 0 for e in epochs):
        result.add("recipe", "resume", f"resume: the scheduler is carried over (at step {max(epochs)}) but the "
                   "optimizer's state is fresh — its moments restart from zero at a late lr; speculators restores "
                   "both from the checkpoint", 0, max(epochs), source)
    elif has_state and optimizer_step and epochs and any(e != optimizer_step for e in epochs):
        result.add("recipe", "resume", f"resume: the optimizer's state is at step {optimizer_step} but the scheduler "
                   f"at {epochs}: they were saved or restored at different steps", optimizer_step, epochs[0], source,
                   severity="warning")


def shards(result: RunAudit, steps: list[dict]) -> None:
    for i, s in enumerate(steps):
        ranks = s.get("ranks_embedded")
        if not ranks:
            continue
        seen: dict[str, int] = {}
        for rank, digest in enumerate(ranks):
            if digest is not None and digest in seen:
                result.add("recipe", "shard", f"data sharding: ranks {seen[digest]} and {rank} were fed the same batch "
                           f"at step {i + 1} — every rank trains on the same data, the effective batch is one rank's; "
                           "speculators gives each rank its own shard", f"ranks {seen[digest]}, {rank} equal",
                           "each rank its own shard", "speculators/train/distributed_batch_sampler.py")
                return
            seen.setdefault(digest, rank)
    if any(s.get("ranks_embedded") for s in steps):
        result.facts["shards"] = "each rank was fed its own batch at every step"


def loss(result: RunAudit, steps: list[dict], lr_zero: bool, missing: list[str]) -> None:
    losses = [s["loss"] for s in steps if s["loss"] is not None]
    if all(s["zero_gradients"] or s["params_with_grad"] == 0 for s in steps):
        none = all(s["params_with_grad"] == 0 for s in steps)
        placed = f"; the drafter's {len(missing)} trainable parameters, e.g. {missing[0]}, are in no optimizer" \
            if missing else ""
        after = [s["grad_norm_after_backward"] for s in steps]
        # By value, where the gradient went to zero: already after backward (the loss trains no row), or after it.
        if none:
            why = f"no parameter the optimizer steps gets a gradient (it holds other tensors than the loss reaches{placed})"
        elif all(not a for a in after):
            why = "backward gives every parameter a zero gradient: no row of the loss trains (an empty loss mask?)"
        else:
            top = max(a for a in after if a)
            why = f"every gradient is zero when the optimizer steps, though backward gave them a norm up to {top:.4g}: " \
                  "zeroed between backward and step"
        result.add("loss", "zero_gradients", f"the loss does not train the drafter: {why}; losses "
                   f"{', '.join(f'{v:.6g}' for v in losses)}", 0.0, "a nonzero gradient",
                   "speculators/train/trainer.py: Trainer.train_epoch (zero_grad, backward, clip, step)")
        return
    moved = [s["params_moved"] for s in steps[1:] if s["params_moved"] is not None]
    if moved and all(m == 0 for m in moved) and not lr_zero:
        result.add("loss", "no_update", f"the parameters never change: the optimizer stepped {len(moved)} times with "
                   f"nonzero gradients and no parameter moved; losses {', '.join(f'{v:.6g}' for v in losses)}",
                   0, "every step updates", "speculators/train/trainer.py: Trainer.train_epoch")
        return
    if len(losses) >= 3 and all(_close(v, losses[0], 1e-7) for v in losses) and not lr_zero:
        result.add("loss", "not_moving", f"the loss does not move: {losses[0]:.6g} at each of {len(losses)} steps",
                   losses[0], "a loss that changes", "speculators/train/trainer.py: Trainer.train_epoch")
    if losses and any(not math.isfinite(v) for v in losses):
        result.add("loss", "not_finite", f"the loss is not finite at step {next(i + 1 for i, v in enumerate(losses) if not math.isfinite(v))}",
                   None, "finite", "")
