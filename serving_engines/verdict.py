"""The verdict: a served spec held against the trained one. Every difference is a `serving` finding naming the
engine, the field, the trained and served values and the engine's file:line; an unknown trained value stays
unknown (a warning naming the `--spec KEY=VALUE` that supplies it). Needs only a DraftSpec, so the conformance
self-test plants serving bugs through it too."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from catalogue.findings import Finding, serialized
from foundation.target_vocab import mask_token_problems
from impl.spec import DraftSpec
from serving_engines.layer_capture import trained_capture
from serving_engines.rules import source as engine_source
from serving_engines.served import Served, TargetFacts

# Spec fields whose "default" provenance is our loader's guess, not the format's documented meaning.
GUESSED_DEFAULTS = {"target_layer_ids": "target_layer_ids", "rope_theta": "rope_theta",
                    "mask_token_id": "mask_token_id", "sliding_window": "layer_windows",
                    "layer_types": "layer_types", "rms_norm_eps": "rms_norm_eps", "hidden_act": "hidden_act"}
# Served fields compared with training, each with the catalogue entry that explains it.
COMPARED = {"target_layer_ids": 26, "layer_types": 27, "layer_windows": 27, "layer_causal": 27,
            "mask_token_id": 28, "block_size": 29, "rope_theta": 30, "rope_type": 30, "partial_rotary_factor": 30,
            "is_neox_style": 30, "rms_norm_eps": 31, "hidden_act": 31, "vocab_size": 31, "draft_vocab_size": 31,
            "input_embedding_scale": 31, "output_multiplier": 31, "final_logit_softcapping": 31,
            "conv_kernel_size": 31, "conv_group_size": 31, "selector_rank": 31, "selector_top_k": 31,
            "tensors_ignored": 31, "tensors_refused": 31, "sample_from_anchor": 33,
            "draft_to_target": 32, "target_layer_capture": 26,
            # DSpark's heads (#37) and XPress's refiner (#38) as the engine builds and resolves them.
            "markov_head_type": 37, "markov_rank": 37, "enable_confidence_head": 37,
            "confidence_head_with_markov": 37, "num_jacobi_passes": 38, "xpress_rank": 38,
            "xpress_mlp_hidden": 38, "refiner_block_size": 38, "refiner_candidates": 38, "refiner_slot0": 38}
# What speculators' XPress trains slot 0's refiner on (models/xpress/core.py `am1_tokens`), per slot layout.
SLOT0_TRAINED = {False: "the token before the anchor", True: "the anchor"}


LAYER_WORDS = {"layer_types": "attention type", "layer_windows": "sliding window", "layer_causal": "causality"}


@dataclass
class EngineReport:
    engine: str
    version: str
    loads: bool
    error: str | None
    served: dict[str, Any]
    trained: dict[str, Any]
    findings: list[Finding]
    command: str | None
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    step: str | None = None  # what had to be done first for the engine to read the drafter (a step, not a defect)
    # `--live`: the drafter run in the engine, its findings `Finding` records (dflash_audit/audit/live_report.py)
    live: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The one serialization of the engine's section, its findings and the live section's written here."""
        data = asdict(replace(self, findings=[], live=None))
        data["findings"] = [f.to_dict() for f in self.findings]
        if self.live is None:
            del data["live"]
        else:
            data["live"] = serialized(self.live)
        return data


def trained_values(spec: DraftSpec, draft_vocab_size: int | None = None,
                   defaulted: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(served-field -> trained value, served-field -> why unknown). Unknown values are None. `defaulted`: spec
    field -> why its value is a loader default (provenance), not what the drafter declares."""
    n = spec.num_hidden_layers
    values: dict[str, Any] = {
        "target_layer_ids": list(spec.target_layer_ids), "layer_types": list(spec.layer_types),
        "layer_windows": [spec.window_of(i) for i in range(n)],
        "layer_causal": [spec.block_is_causal(i) for i in range(n)],
        "mask_token_id": spec.mask_token_id, "block_size": spec.block_size, "rope_theta": float(spec.rope_theta),
        # The spec's rotary settings as the drafter's config declares them (#35 compares them with what the
        # references apply).
        "rope_type": (spec.rope_scaling or {}).get("rope_type", "default"),
        "partial_rotary_factor": float(spec.partial_rotary_factor), "is_neox_style": spec.rope_style == "neox",
        "rms_norm_eps": float(spec.rms_norm_eps), "hidden_act": spec.hidden_act, "vocab_size": spec.target_vocab_size,
        "draft_vocab_size": draft_vocab_size or spec.head_size,
        # How draft ids become target ids (#32): a reduced head's own d2t offsets, else draft id = target id.
        "draft_to_target": "d2t" if (draft_vocab_size or spec.head_size) != spec.target_vocab_size else "identity",
        "input_embedding_scale": float(spec.input_embedding_scale), "tensors_ignored": [], "tensors_refused": [],
        "sample_from_anchor": spec.sample_from_anchor,
        "target_layer_capture": trained_capture(list(spec.target_layer_ids), spec.num_target_layers),
    }
    if spec.family == "dspark":
        values.update(markov_head_type=spec.markov_head_type, markov_rank=spec.markov_rank,
                      enable_confidence_head=spec.enable_confidence_head,
                      confidence_head_with_markov=spec.confidence_head_with_markov)
    if spec.family == "xpress":
        values.update(num_jacobi_passes=spec.num_jacobi_passes, xpress_rank=spec.xpress_rank,
                      xpress_mlp_hidden=spec.xpress_rank * spec.xpress_mlp_ratio, refiner_block_size=spec.block_size,
                      refiner_candidates=spec.target_vocab_size,  # every pass scores the whole vocabulary
                      refiner_slot0=SLOT0_TRAINED[spec.sample_from_anchor])
    if spec.family == "dflash2":
        values.update(conv_kernel_size=spec.conv_kernel_size, conv_group_size=spec.conv_group_size,
                      selector_rank=spec.selector_rank, selector_top_k=spec.selector_top_k,
                      output_multiplier=float(spec.output_multiplier),
                      final_logit_softcapping=spec.final_logit_softcapping)
    unknown = {}
    for spec_field, served_field in GUESSED_DEFAULTS.items():
        if spec_field in (defaulted or {}):
            unknown[served_field] = f"{defaulted[spec_field]}; give it with --spec {spec_field}=VALUE"
            values[served_field] = None
            if served_field == "layer_windows":
                values["layer_causal"] = None
            if served_field == "target_layer_ids":  # which tensors fed those layers: as unknown as the ids
                values["target_layer_capture"] = None
    return values, unknown


def _differing_layers(trained: list, served: list) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(trained, served)) if a != b]


def compare_field(engine: str, name: str, trained: Any, served: Any, source: str | None = None,
                  refused: bool = False) -> Finding | None:
    """`refused`: the engine refuses the drafter anyway; the value is what its files would run it with."""
    if trained == served or name not in COMPARED:
        return None
    if isinstance(trained, float) and isinstance(served, float) and abs(trained - served) <= 1e-12 * abs(trained):
        return None
    source = source or engine_source(engine, name)
    pitfall = COMPARED[name]
    if name.startswith("tensors_"):
        verb = "drops silently" if name == "tensors_ignored" else "refuses to load the drafter over"
        return Finding.serving(name, "divergence", trained, served, source,
                              f"{engine} {verb} {len(served)} tensor(s) the drafter was trained with "
                              f"({', '.join(served[:3])})", pitfall=pitfall)
    if name == "target_layer_capture" and isinstance(trained, list) and isinstance(served, list) \
            and len(trained) == len(served):  # (ids of another count: the target_layer_ids finding says it)
        ids = [i for i, (a, b) in enumerate(zip(trained, served)) if a != b]
        detail = "; ".join(f"trained on the residual stream {trained[i]}, served {served[i]}" for i in ids)
        return Finding.serving(name, "divergence", trained, served, source,
                              f"{engine} feeds the drafter another tensor than training for {len(ids)} declared "
                              f"target layer(s) ({detail})", pitfall=pitfall)
    if isinstance(trained, list) and isinstance(served, list) and name.startswith("layer_") \
            and len(trained) == len(served):
        layers = _differing_layers(trained, served)
        detail = "; ".join(f"layer {i}: trained {trained[i]}, served {served[i]}" for i in layers)
        return Finding.serving(name, "divergence", trained, served, source,
                              f"{engine} runs draft layer(s) {layers} with a different {LAYER_WORDS[name]} "
                              f"than training ({detail})", pitfall=pitfall)
    return Finding.serving(name, "divergence", trained, served, source,
                          f"{engine} {'would run' if refused else 'runs'} {name} = {served!r}; the drafter was trained "
                          f"with {trained!r}", pitfall=pitfall)


def target_layer_finding(engine: str, trained: list[int] | None, unknown: str | None, served: Served,
                         trained_count: int | None = None) -> Finding | None:
    """The ids the engine feeds the drafter against the trained ones, as one finding: the capture of those ids
    follows from them. Ids the config leaves undeclared are the engine's guess (z-lab #156/#157, sglang #37475),
    of whatever count it guesses, cited where the engine guesses them. `unknown`: why the trained ids are unknown;
    `trained_count`: how many the drafter's fc reads, known even then."""
    ids = served.values["target_layer_ids"]
    guessed = served.values.get("target_layer_ids_declared") is False
    source = served.sources.get("target_layer_ids_declared" if guessed else "target_layer_ids", "")
    runs = f"the config declares no target layer ids: {engine} guesses {ids}" if guessed \
        else f"{engine} feeds the drafter target layers {ids}"
    if (unknown is not None or trained is None) and trained_count not in (None, len(ids)):
        return Finding.serving("target_layer_ids", "divergence", None, ids, source,
                              f"{runs}: {len(ids)} layer(s), where the drafter's fc reads {trained_count} (which ones "
                              f"is unknown: {unknown or 'not recorded'})", pitfall=26)
    if unknown is not None or trained is None:
        return Finding.serving("target_layer_ids", "warning", None, ids, source,
                              f"{runs}; the trained ids are unknown ({unknown or 'not recorded'})", pitfall=26)
    if list(trained) == list(ids):
        return Finding.serving("target_layer_ids", "warning", list(trained), ids, source,
                              f"{runs}, as training did; declare them so that no engine has to guess",
                              pitfall=26) if guessed else None
    count = "" if len(trained) == len(ids) else f": {len(ids)} layer(s), where the drafter's fc reads {len(trained)}"
    return Finding.serving("target_layer_ids", "divergence", list(trained), ids, source,
                          f"{runs}{count}; the drafter was trained on {list(trained)}", pitfall=26)


def mask_token_findings(engine: str, mask: int | None, target: TargetFacts, source: str = "") -> list[Finding]:
    source = source or engine_source(engine, "mask_token_id")
    if mask is None:
        return []
    if target.vocab_size is None and target.embedding_rows is None and not target.eos_token_ids:
        return [Finding.serving("mask_token_id", "warning", None, mask, source,
                               f"whether mask token {mask} is inside the target's vocabulary and embedding and distinct "
                               "from its eos/pad tokens is unknown without --target", pitfall=28)]
    limits = {"vocabulary": target.vocab_size, "embedding": target.embedding_rows}
    special = {"eos": target.eos_token_ids, "pad": target.pad_token_ids}
    consequence = {"outside": "",
                   "special": ": the engine feeds a real token as the mask and a decode loop that stops or drops on "
                              "it misbehaves"}
    return [Finding.serving("mask_token_id", "divergence", None, mask, source, f"mask token {mask} is {phrase}"
                           + consequence[kind], pitfall=28)
            for kind, phrase in mask_token_problems(mask, limits, special)]


# What each engine's argmax drafting is switched by, for the draft_sampling finding.
SAMPLING_SWITCH = {"llamacpp": ("llama-server", "--spec-draft-sampling probabilistic"),
                   "vllm": ("vLLM", "speculative_config draft_sample_method='probabilistic'; its default is 'greedy'")}


def draft_sampling_finding(engine: str, served: Served) -> list[Finding]:
    """An engine that drafts the argmax at every temperature, where z-lab's loop samples its drafts at T > 0."""
    if served.values.get("draft_sampling") != "argmax":
        return []
    from serving_engines.source_exec import cite

    name, switch = SAMPLING_SWITCH[engine]
    zlab = cite("dflash.model", "block_output_ids[:, 1:] = _sample_probs(draft_probs)")
    return [Finding.serving(
        "draft_sampling", "info", "sampled at T > 0", "argmax", served.sources.get("draft_sampling", ""),
        f"{name} drafts the argmax at every temperature (unless {switch}): at T > 0 its acceptance is the sampled "
        f"target's agreement with the greedy draft, where z-lab's loop samples its drafts ({zlab})")]


def command_findings(served: Served, spec: DraftSpec) -> list[Finding]:
    """llama-server's command-line settings that change what is drafted: the draft length left at its default,
    a draft KV cache that rounds keys and values."""
    from serving_engines.llamacpp_engine import DEFAULT_N_MAX, EXACT_KV_TYPES

    values, sources, found = served.values, served.sources, []
    if values.get("spec_draft_n_max_given") is False and spec.block_size - 1 != DEFAULT_N_MAX:
        found.append(Finding.serving(
            "spec_draft_n_max", "warning", spec.block_size - 1, DEFAULT_N_MAX, sources.get("spec_draft_n_max", ""),
            f"llama-server drafts {DEFAULT_N_MAX} tokens when --spec-draft-n-max is left out; this drafter was "
            f"trained for blocks of {spec.block_size}: pass --spec-draft-n-max {spec.block_size - 1}", pitfall=29))
    kind = values.get("draft_kv_type")
    if kind is not None and kind not in EXACT_KV_TYPES:
        found.append(Finding.serving(
            "draft_kv_type", "warning", "f16", kind, sources.get("draft_kv_type", ""),
            f"a {kind} draft KV cache rounds the context keys and values the drafter was trained on exactly "
            "(llama.cpp #25725: acceptance near 0 with q8_0)"))
    return found


def folder_findings(engine: str, path: Path, served: Served, trained: dict[str, Any],
                    target: TargetFacts) -> list[Finding]:
    """The folder's keys and files held to what the reference does with them (`key_verdict.py`), where the engine
    loads the drafter from a folder with a config.json."""
    from serving_engines.key_verdict import file_findings, folder_view, key_findings

    view = folder_view(path) if path.is_dir() else None
    if view is None or not served.loads:
        return []
    return key_findings(engine, view, served.values, trained) + file_findings(engine, view, target.path)


def engine_report(engine: str, path: str, spec: DraftSpec, target: TargetFacts,
                  trained: tuple[dict[str, Any], dict[str, str]] | None = None, reference: str | None = None,
                  **options) -> EngineReport:
    """How `engine` serves the drafter directory `path` that was trained as `spec` (`trained`: the values
    and unknowns from `trained_values`, when the caller knows more than the spec). `reference`: the folder's own
    format (zlab, speculators) when it is the drafter as given, so that its rotary settings are held to what that
    reference applies; None for a folder converted from our checkpoint (our trainer applies what it declares).
    `options`: the engine's command (llama.cpp: n_max, kv_type)."""
    from serving_engines.dispatch import resolve

    trained, unknown = trained or trained_values(spec)
    applied: dict[str, str] = {}  # rotary field -> why the reference applies another value than the folder declares
    if reference is not None and Path(path).is_dir():
        from serving_engines.key_verdict import reference_rotary

        trained, applied = reference_rotary(Path(path), trained)
    served = resolve(engine, path, target, spec.block_size, spec.num_target_layers, **options)
    findings: list[Finding] = []
    if served.refused_for:  # a value the engine refuses: one finding, under that field's entry
        name = served.refused_for
        findings.append(Finding.serving(name, "divergence", trained.get(name), served.values.get(name),
                                       served.sources.get(name, ""), f"{engine} refuses the drafter: {served.error}",
                                       pitfall=COMPARED.get(name)))
    elif not served.loads and (served.config_refused or not served.values.get("tensors_refused")):
        # (refused tensors alone: that finding says it)
        findings.append(Finding.serving("loads", "divergence", True, False,
                                       served.sources.get("loads") or engine_source(engine, "loads"),
                                       f"{engine} refuses the drafter: {served.error}", pitfall=31))
    ids_judged = served.loads and served.values.get("target_layer_ids") is not None
    ids_differ = False
    if ids_judged:
        finding = target_layer_finding(engine, trained.get("target_layer_ids"), unknown.get("target_layer_ids"),
                                       served, trained.get("target_layer_count"))
        findings += [finding] if finding is not None else []
        # the capture of ids that differ from training, or of unknown trained ids, is that one finding's
        ids_differ = finding is not None and (finding.severity == "divergence" or finding.trained is None)
    for name, trained_value in trained.items():
        served_value = served.values.get(name)
        if name not in served.values or not served.loads and served_value is None or name == served.refused_for \
                or name in served.covered:
            continue
        if ids_judged and name == "target_layer_ids" or ids_differ and name == "target_layer_capture":
            continue  # judged above, as one finding
        source = served.sources.get(name, "")
        if name in unknown:
            findings.append(Finding.serving(name, "warning", None, served_value, source,
                                           f"the trained {name} is unknown ({unknown[name]}); {engine} will run "
                                           f"{served_value!r}", pitfall=COMPARED.get(name)))
        elif served_value is None and trained_value is not None:
            findings.append(Finding.serving(name, "warning", trained_value, None, source,
                                           f"what {engine} runs for {name} is unknown without --target",
                                           pitfall=COMPARED.get(name)))
        else:
            finding = compare_field(engine, name, trained_value, served_value, source, refused=not served.loads)
            if finding is not None and name in applied:
                from serving_engines.key_verdict import rotary_message

                finding.message = rotary_message(engine, name, served_value, applied[name])
            if finding is not None:
                findings.append(finding)
    if served.loads:
        findings += mask_token_findings(engine, served.values.get("mask_token_id"), target,
                                        served.sources.get("mask_token_id", ""))
    if engine == "llamacpp":
        findings += command_findings(served, spec)
    findings += draft_sampling_finding(engine, served) if engine in SAMPLING_SWITCH else []
    findings += folder_findings(engine, Path(path), served, trained, target)
    return EngineReport(engine, served.version, served.loads, served.error, served.values, trained, findings,
                        served.command, served.sources, served.notes)


