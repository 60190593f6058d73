"""Conversion between the three drafter formats: ours (`*.pt`), zlab and speculators (directories).

The draft body is copied tensor for tensor by the destination format's own `save`
(`dflash_audit/formats/`); only the layer-id convention changes (z-lab id i <-> speculators
aux id i + 1). A conversion that would change what the drafter computes is
refused unless `allow_lossy`; settings the destination merely cannot record (the
training recipe) are reported as notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_audit.formats import FORMATS, MODULES, LoadedCheckpoint, LoadOptions, load_any, require_spec
from dflash_audit.outputs import check_outputs, check_replaceable, check_writable
from foundation.errors import AuditError
from foundation.inputs import check_target_dir
from impl.defaults import ZLAB_EXTRAS
from impl.families import TITLES, ZLAB_ARCHITECTURES
from impl.layers import names_final_layer
from foundation.packages import PINNED

if TYPE_CHECKING:
    from dflash_audit.flags.convert import ConvertFlags


@dataclass
class ConversionResult:
    source: str
    source_format: str
    destination: str
    format: str
    notes: list[str] = field(default_factory=list)


# -- what a destination cannot hold ---------------------------------------------------------
def lossy_changes(loaded: LoadedCheckpoint, fmt: str) -> list[str]:
    """Ways the converted drafter would compute something else than the source."""
    spec, changes = loaded.spec, []
    if fmt == "speculators":
        final = [i for i in spec.target_layer_ids if names_final_layer(i, spec.num_target_layers)]
        if final:
            changes.append(f"target layer {final[0]} is the verifier's final layer, which speculators does not feed "
                           "to fc (its fc columns would be dropped)")
        changed = [name for name, default in ZLAB_EXTRAS.items() if getattr(spec, name) != default]
        if changed:
            changes.append(f"speculators has no {', '.join(changed)} (z-lab dflash_config)")
    return changes  # a reduced draft vocabulary travels in every format (its head and d2t)


def recipe_notes(loaded: LoadedCheckpoint, fmt: str) -> list[str]:
    notes = []
    if loaded.recipe_unknown:
        notes.append(f"recipe fields never declared by the source stay unknown: {', '.join(loaded.recipe_unknown)}")
    if loaded.recipe is not None and fmt != "ours":
        notes.append(f"the training recipe (gamma {loaded.recipe.gamma}, {loaded.recipe.loss_fn}, ...) is not "
                     f"recorded by the {fmt} format; the weights are unchanged")
    if loaded.verifier_tensors and fmt != "speculators":
        notes.append(f"verifier-owned tensors {sorted(loaded.verifier_tensors)} dropped: {fmt} borrows them from "
                     "the target")
    return notes


# -- entry point ------------------------------------------------------------------------------
def check_destination(source: Path, destination: Path, fmt: str, target: str | Path | None, force: bool) -> None:
    """Before loading anything: --to is no input, replaces only a drafter of this format (--force), is writable."""
    check_outputs({"--to": destination}, {"--from": source, "--target": Path(target) if target else None})
    check_replaceable("--to", destination, fmt, force)
    check_writable("--to", destination, "file" if fmt == "ours" else "dir")


def convert(source: str | Path, destination: str | Path, fmt: str, target: str | Path | None = None,
            allow_lossy: bool = False, force: bool = False, options: LoadOptions | None = None) -> ConversionResult:
    if fmt not in FORMATS:
        raise AuditError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")
    source, destination = Path(source), Path(destination)
    if fmt == "ours" and (destination.is_dir() or destination.suffix != ".pt"):
        raise AuditError(f"{destination}: the ours format is a single *.pt file")
    if fmt != "ours" and destination.is_file():
        raise AuditError(f"{destination}: a file; the {fmt} format is a directory")
    check_destination(source, destination, fmt, target, force)
    if fmt == "speculators" and target is not None:
        from dflash_audit.formats.speculators import check_verifier_weights

        check_target_dir(Path(target), "--target", tokenizer=False)
        check_verifier_weights(target)  # before the drafter is loaded: what speculators will read is there
    loaded = load_any(source, target_dir=target, options=options or LoadOptions(flag_prefix=""))
    require_spec(loaded, "convert")
    if fmt == "zlab" and loaded.spec.family not in ZLAB_ARCHITECTURES:
        raise AuditError(f"{source}: a {TITLES[loaded.spec.family]} drafter has no z-lab format (dflash "
                         f"{PINNED['dflash']} defines DFlashDraftModel and DFlash2DraftModel only); convert it to "
                         "ours or speculators")
    if loaded.contradictions:
        raise AuditError(f"{source}: contradicts itself ({loaded.contradictions[0]}); settle it with --spec "
                         "before converting")
    unmapped = loaded.foreign.get("key_map", {}).get("unmapped", [])
    if unmapped:
        raise AuditError(f"{source}: {len(unmapped)} tensor(s) map to no DFlash parameter (first: {unmapped[0]!r}); "
                         "a conversion would drop them: map them with --key-map or remove them")
    changes = lossy_changes(loaded, fmt)
    if changes and not allow_lossy:
        raise AuditError(f"{source} -> {fmt} would change the drafter: {'; '.join(changes)}; "
                         "pass --allow-lossy to convert anyway")
    if fmt == "speculators":
        MODULES[fmt].save(loaded, destination, target)
    else:
        MODULES[fmt].save(loaded, destination)
    notes = [f"lossy: {change}" for change in changes] + recipe_notes(loaded, fmt)
    return ConversionResult(source=str(source), source_format=loaded.format, destination=str(destination),
                            format=fmt, notes=notes)


# -- convert --for ENGINE ---------------------------------------------------------------------
# Both engines read the z-lab format (SGLang reads no other); written by us it declares every field explicitly
# (target_layer_ids, rope_parameters, layer_types, sliding_window, is_causal when bidirectional) and stores the
# DFlash2 codebooks under the bare names both engines' parameters have. Fields no engine format can carry:
UNSERVABLE = {"sglang": {"input_embedding_scale": (1.0, "SGLang takes the noise-embedding scale from the target "
                                                        "model, never from the draft config"),
                         "hidden_act": (("silu", "swigluoai"), "SGLang's DFlash MLP supports silu and swigluoai only"),
                         "sample_from_anchor": (False, "SGLang's DFlash worker drafts with the anchor as the bonus "
                                                       "token (slots 1..B-1); only its DSpark models sample from the "
                                                       "anchor")},
              "vllm": {"sample_from_anchor": (False, "vLLM's DFlash runner reads dflash_config.sample_from_anchor and "
                                                     "refuses true (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"
                                                     "); only its DSpark runner samples from the anchor")}}


# The other two families: what no format changes (the engine's own code), per (family, engine); the rest as above.
FAMILY_UNSERVABLE = {
    ("xpress", "vllm"): "vLLM's XPress runner feeds the refiner's slot 0 the anchor itself (tok_am1 = anchor_ids, "
                        "vllm/v1/worker/gpu/spec_decode/xpress/speculator.py) where speculators trains it on the token "
                        "before the anchor, and its speculators translation has no xpress",
    ("xpress", "sglang"): "SGLang 0.5.23 has no XPress",
    ("dspark", "sglang"): "SGLang 0.5.23's DSPARK reads a draft config transformers' AutoConfig knows, and no DSpark "
                          "format of that kind exists (z-lab has none; speculators' has no model_type)",
}
# vLLM's DSpark runner samples from the anchor or not (the config's sample_from_anchor); its model builds the vanilla
# Markov head only (vllm/model_executor/models/qwen3_dspark.py). Its DFlash model has no input embedding scale.
FAMILY_FIELDS = {("dflash", "vllm"): {"input_embedding_scale": (
                     1.0, "vLLM's DFlash model (qwen3_dflash.py) scales no noise embedding: only its DFlash2 model "
                          "reads dflash_config.input_embedding_scale")},
                 ("dspark", "vllm"): {"sample_from_anchor": ((False, True), ""),
                                      "markov_head_type": ("vanilla", "vLLM's Qwen3DSparkModel builds the vanilla "
                                                                      "Markov head only")}}
# The format each engine reads a family from (z-lab has no DSpark: vLLM translates speculators' own config).
FAMILY_FORMATS = {("dspark", "vllm"): "speculators"}

ENGINE_SIDE = ("target_layer_capture",)


def unservable_fields(spec, engine: str) -> list[str]:
    if (spec.family, engine) in FAMILY_UNSERVABLE:
        from impl.families import TITLES

        return [f"the {TITLES[spec.family]} family: {FAMILY_UNSERVABLE[spec.family, engine]}"]
    problems = []
    rules = {**UNSERVABLE.get(engine, {}), **FAMILY_FIELDS.get((spec.family, engine), {})}
    for name, (allowed, why) in rules.items():
        value = getattr(spec, name)
        if value != allowed and not (isinstance(allowed, tuple) and value in allowed):
            problems.append(f"{name} = {value!r}: {why}")
    return problems


def convert_for_llamacpp(source: str | Path, destination: str | Path, target: str | Path | None,
                         quant: str = "f32", force: bool = False, options: LoadOptions | None = None,
                         bin_dir: str | Path | None = None, verify: bool = True) -> ConversionResult:
    """`DIR/drafter-<quant>.gguf` by llama.cpp's own converter (and llama-quantize), the target's GGUF converted once
    into the engine cache; a drafter in another format goes through our z-lab format first. Then the static check
    reads the file as b11434 does."""
    import tempfile

    from serving_engines import TargetFacts
    from serving_engines.live.llamacpp_convert import QUANTIZER_TYPES, drafter_gguf, target_gguf
    from serving_engines.live.llamacpp_env import find_llamacpp
    from serving_engines.verdict import engine_report

    if target is None:
        raise AuditError("--for llamacpp: give --target (llama.cpp's converter takes the tokenizer, and the "
                         "drafter's embeddings and head, from the target)")
    check_target_dir(Path(target))
    loaded = load_any(source, target_dir=target, options=options or LoadOptions(flag_prefix=""))
    spec = require_spec(loaded, "convert --for llamacpp")
    out_dir = Path(destination)
    out = out_dir / f"drafter-{quant}.gguf"
    if out_dir.exists() and not out_dir.is_dir():
        raise AuditError(f"--to: {out_dir} is a file; --for llamacpp writes a directory (drafter-{quant}.gguf in it)")
    if out.exists() and not force:
        raise AuditError(f"--to: {out} exists; give --force to replace it")
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = find_llamacpp(bin_dir) if quant in QUANTIZER_TYPES or bin_dir is not None else None
    result = ConversionResult(str(source), loaded.format, str(out), "gguf")
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".zlab-") as scratch:
        zlab_dir = Path(source)
        if loaded.format != "zlab":
            zlab_dir = Path(scratch) / "zlab"
            step = convert(source, zlab_dir, "zlab", target=target, options=options)
            result.notes.append(f"converted through our z-lab format first ({loaded.format} -> zlab): llama.cpp's "
                                "converter reads z-lab's DFlashDraftModel, not " +
                                ("speculators' DFlashSpeculator" if loaded.format == "speculators" else
                                 "our ckpt.pt" if loaded.format == "ours" else f"a {loaded.format} checkpoint"))
            result.notes += step.notes
        result.notes += drafter_gguf(zlab_dir, Path(target), out, quant, engine)
    target_file, notes = target_gguf(Path(target))
    result.notes += [f"target: {note}" for note in notes]
    result.notes.append(f"the target's GGUF (f32, converted once, cached): {target_file}")
    if not verify:  # the live check serves it and holds every round instead
        return result
    report = engine_report("llamacpp", str(out), spec, TargetFacts.read(target))
    engine_side = [f for f in report.findings if f.severity == "divergence" and f.field in ENGINE_SIDE]
    wrong = [f for f in report.findings if f.severity == "divergence" and f.field not in ENGINE_SIDE]
    if wrong:
        raise AuditError(f"{out}: written, but llama.cpp b11434 would still serve it differently from training: "
                         f"{wrong[0].field}: {wrong[0].message} ({wrong[0].source})")
    result.notes.append(f"verified: llama.cpp {report.version} reads its settings as trained; serve it with: "
                        f"{report.command}")
    result.notes += [f"llamacpp (its own forward, no format changes it): {f.message} ({f.source})"
                     for f in engine_side]
    return result


def convert_for(source: str | Path, destination: str | Path, engine: str, target: str | Path | None = None,
                force: bool = False, options: LoadOptions | None = None) -> ConversionResult:
    """Write the drafter so that `engine` serves it as trained, then prove it with the serving check."""
    from serving_engines import TargetFacts
    from serving_engines.verdict import engine_report

    if engine == "llamacpp":
        return convert_for_llamacpp(source, destination, target, force=force, options=options)
    options = options or LoadOptions(flag_prefix="")
    loaded = load_any(source, target_dir=target, options=options)
    spec = require_spec(loaded, f"convert --for {engine}")
    problems = unservable_fields(spec, engine)
    if problems:
        raise AuditError(f"{source}: no format makes {engine} serve this drafter as trained: {'; '.join(problems)}")
    result = convert(source, destination, FAMILY_FORMATS.get((spec.family, engine), "zlab"), target=target,
                     force=force, options=options)
    report = engine_report(engine, str(destination), spec, TargetFacts.read(target))
    # Which tensor the engine captures for each target layer is its forward's, not the file's: no format changes
    # it, so it is said, not refused.
    engine_side = [f for f in report.findings if f.severity == "divergence" and f.field in ENGINE_SIDE]
    wrong = [f for f in report.findings if f.severity == "divergence" and f.field not in ENGINE_SIDE]
    if wrong:
        raise AuditError(f"{destination}: written, but {engine} would still serve it differently from training: "
                         f"{wrong[0].field}: {wrong[0].message}")
    result.notes.append(f"verified: {engine} {report.version} serves it as trained; serve it with: {report.command}")
    result.notes += [f"{engine}: {note}" for note in report.notes]
    result.notes += [f"{engine} (its own forward, no format changes it): {f.message} ({f.source})" for f in engine_side]
    return result


def run_convert(flags: ConvertFlags) -> ConversionResult:
    """`convert`'s validated flags, run: to a format (`--format`), or what an engine serves as trained (`--for`)."""
    from loguru import logger

    logger.disable("speculators")  # its per-tensor INFO lines would bury the one-line result
    source, destination, target, options = flags.source, flags.destination, flags.target, flags.load_options
    if flags.engine == "llamacpp":
        return convert_for_llamacpp(source, destination, target, flags.quant or "f32", force=flags.force,
                                    options=options, bin_dir=flags.llamacpp_bin)
    if flags.engine is not None:
        return convert_for(source, destination, flags.engine, target=target, force=flags.force, options=options)
    return convert(source, destination, flags.fmt, target=target, allow_lossy=flags.allow_lossy, force=flags.force,
                   options=options)
