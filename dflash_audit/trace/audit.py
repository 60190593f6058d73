"""The audit of a trace recording: each recorded tensor named by value (matcher.py), then held to the reference, one
finding per root cause, with its numbers and its catalogue entry.

The reference: the layer ids fc reads come from `--ref` (a config declaring `target_layer_ids`) or else z-lab's
`build_target_layer_ids` for the target's and the drafter's depth; the recipe (loss kind, weighting, gamma) is
speculators' reference recipe chosen by `yardstick_for` from what the trainer was found to do, as `compare` holds
a checkpoint's recipe; block size and mask id are the drafter's own declared ones (or `--ref`'s).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from catalogue.pitfalls import RECIPE_ENTRIES
from catalogue.findings import Finding, divergences, sort_findings
from dflash_audit.trace.loss_fit import REFERENCE_REDUCTION, fit_weights, reductions, slot_means
from dflash_audit.trace.matcher import Named, TargetCandidates, centered_log_probs, name_rows, tolerance
from dflash_audit.trace.recording import ID_ROLES, Recording
from foundation.config_values import as_int
from foundation.errors import AuditError, SpecError
from foundation.inputs import read_json_object
from foundation.token_ids import outside_vocabulary
from impl.recipe import Recipe


@dataclass
class Reference:
    layer_ids: list[int]
    layer_source: str
    block_size: int | None
    block_source: str
    mask_token_id: int | None
    mask_source: str


def read_ref(path: Path | None) -> dict[str, Any]:
    """`--ref`: a config.json (or a folder holding one) declaring target_layer_ids / block_size / mask_token_id,
    at its top level or under `dflash_config`."""
    if path is None:
        return {}
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise AuditError(f"--ref {path}: no config.json there")
    data = read_json_object(file, "config.json", lambda message: AuditError(f"--ref {message}"))
    nested = data.get("dflash_config") if isinstance(data.get("dflash_config"), dict) else {}
    found = {name: nested.get(name, data.get(name)) for name in ("target_layer_ids", "block_size", "mask_token_id")}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        raise AuditError(f"--ref {file}: declares none of target_layer_ids, block_size, mask_token_id")
    try:  # read strictly: the ids a list of whole numbers, the block and the mask id whole numbers of their range
        if "target_layer_ids" in found:
            ids = found["target_layer_ids"]
            if not isinstance(ids, list) or not ids:
                raise SpecError("target_layer_ids", f"{ids!r:.60} is not a list of layer ids")
            found["target_layer_ids"] = [as_int("target_layer_ids", i) for i in ids]
            if min(found["target_layer_ids"]) < 0:
                raise SpecError("target_layer_ids", f"{ids!r:.60} holds a negative layer id")
        for name, least in (("block_size", 1), ("mask_token_id", 0)):
            if name in found and as_int(name, found[name]) < least:
                raise SpecError(name, f"{found[name]!r} is below {least}")
    except SpecError as exc:
        raise AuditError(f"--ref {file}: {exc}") from None
    return {"file": str(file), **found}


def reference_for(drafter_facts: dict, target_layers: int, ref: dict) -> Reference:
    from reference_adapters.zlab_adapter import ZlabImplementation
    from foundation.packages import installed_version

    draft_layers = drafter_facts.get("num_hidden_layers")
    if "target_layer_ids" in ref:
        ids, source = [int(i) for i in ref["target_layer_ids"]], f"--ref {ref['file']}"
    elif draft_layers:
        ids = ZlabImplementation().default_target_layer_ids(target_layers, int(draft_layers))
        source = (f"for {target_layers} target layers and {draft_layers} draft layers, z-lab's "
                  f"build_target_layer_ids (dflash {installed_version('dflash')})")
    else:
        ids, source = [], "unknown (the drafter's depth was not recorded)"
    block = ref.get("block_size", drafter_facts.get("block_size"))
    block_source = f"--ref {ref['file']}" if "block_size" in ref else "the drafter's config"
    mask = ref.get("mask_token_id", drafter_facts.get("mask_token_id"))
    mask_source = f"--ref {ref['file']}" if "mask_token_id" in ref else "the drafter's config"
    return Reference(ids, source, int(block) if block is not None else None, block_source,
                     int(mask) if mask is not None else None, mask_source)


@dataclass
class TensorRow:
    step: int
    name: str
    role: str
    shape: list[int]
    device: str
    what: str
    distance: float | None = None


@dataclass
class TraceReport:
    findings: list[Finding]
    tensors: list[TensorRow]
    facts: dict[str, Any]
    flow: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def divergences(self) -> list[Finding]:
        return divergences(self.findings)

    @property
    def exit_status(self) -> int:
        return 1 if self.divergences else 0


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).float()


class StepAudit:
    """One recorded step against the target's candidates."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor], cands: TargetCandidates, ref: Reference,
                 pad_id: int | None, step_index: int):
        self.meta, self.tensors, self.cands, self.ref = meta, tensors, cands, ref
        self.entries = meta["entries"]
        self.pad_id = pad_id
        self.step = step_index
        self.findings: list[Finding] = []
        self.rows: dict[str, TensorRow] = {}
        self.hidden_size = next(iter(cands.hidden.values())).shape[-1]
        self.vocab = next(iter(cands.logits.values())).shape[-1]
        self.flow: dict[str, Any] = {"fc_layers": [], "divergent": set()}
        self.drafter_facts = meta["drafter"]["facts"]

    def tol(self, name: str) -> float:
        return tolerance(self.entries[name]["dtype"])

    def account(self, name: str, what: str, distance: float | None = None) -> None:
        e = self.entries[name]
        self.rows[name] = TensorRow(self.step, name, e["role"], e["shape"], str(e.get("device", "?")), what,
                                     distance)

    def of_role(self, role: str) -> list[str]:
        return [n for n, e in self.entries.items() if e["role"] == role]

    def add(self, finding: Finding, edge: str | None = None) -> None:
        self.findings.append(finding)
        if edge and finding.severity == "divergence":
            self.flow["divergent"].add(edge)

    # ----------------------------------------------------------------------------------------------------------
    def run(self) -> None:
        for name in self.of_role("tokens"):
            self.account(name, "the target's input ids (the candidates are recomputed from them)")
        for name in self.of_role("target_attention_mask"):
            self.account(name, "the target's attention mask")
        block = self.block_tokens()
        self.context_features()
        slots = self.draft_slots(block)
        self.loss_side(block, slots)
        for name in self.entries:
            if name not in self.rows:
                e = self.entries[name]
                self.account(name, "unexplained: no candidate and no role in the loss")
                self.add(Finding("unexplained", "warning", f"{name} ({e['role']}, shape {e['shape']}) is no tensor "
                                 "the audit can name: no candidate of the target equals it", None, None, key=name))

    # -- the block -----------------------------------------------------------------------------------------------
    def block_tokens(self) -> dict | None:
        """The block's token ids (the ids whose embedding the drafter consumed), its mask id, length and anchors."""
        fed = {n: self.tensors[n] for n in self.of_role("drafter_input")}
        for name in self.of_role("embedding_ids"):
            ids = self.tensors[name]
            emb = self.cands.embed(ids)
            consumed = [n for n, t in fed.items() if t.shape == emb.shape and
                        float((t.float() - emb).abs().max()) <= self.tol(n) * float(emb.abs().max())]
            if not consumed:
                self.account(name, "ids embedded outside the target's forward, not consumed by the drafter")
                continue
            for n in consumed:
                self.account(n, f"the target's embedding of the block tokens ({name})", 0.0)
            return self.analyse_block(name, ids)
        return None

    def analyse_block(self, name: str, ids: torch.Tensor) -> dict:
        ids = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids[None]
        row = ids[0].tolist()
        mask_id, _ = Counter(row).most_common(1)[0]
        starts = [i for i, t in enumerate(row) if t != mask_id]
        gaps = Counter(b - a for a, b in zip(starts, starts[1:]))
        length = gaps.most_common(1)[0][0] if gaps else len(row)
        info = {"ids": ids, "mask_id": mask_id, "length": length, "blocks": len(row) // length if length else 0,
                "anchor_slots": starts}
        self.account(name, f"the block tokens: anchor + {length - 1} x mask id {mask_id}, {info['blocks']} blocks of "
                           f"{length}")
        declared, ref = self.drafter_facts.get("block_size"), self.ref.block_size
        if ref is not None and length != ref:
            self.add(Finding("block_size", "divergence",
                             f"the blocks hold {length} tokens (anchor + {length - 1} masks); {self.ref.block_source} "
                             f"declares block_size {ref}: training drafts {length - 1} tokens a block, serving "
                             f"{ref - 1}", length, ref, pitfall=16, key="block_length",
                             raw={"declared_by_drafter": declared}), edge="block")
        vocab = self.vocab
        if self.pad_id is not None and mask_id == self.pad_id:
            self.add(Finding("mask_token_validity", "divergence",
                             f"the block's mask token is id {mask_id}, the target's pad id: a mask that is the pad "
                             "token is masked out or dropped wherever padding is, and drafts condition on padding",
                             mask_id, "a dedicated id, not the pad id", pitfall=34, key="mask_is_pad"), edge="block")
        elif mask_id >= vocab:
            self.add(Finding("mask_token_validity", "divergence", f"the mask token id {mask_id} is outside the "
                             f"target's vocabulary of {vocab}", mask_id, f"< {vocab}", pitfall=34,
                             key="mask_range"), edge="block")
        elif self.ref.mask_token_id is not None and mask_id != self.ref.mask_token_id:
            self.add(Finding("mask_token", "divergence", f"the block's masked slots hold id {mask_id}; "
                             f"{self.ref.mask_source} declares mask_token_id {self.ref.mask_token_id}", mask_id,
                             self.ref.mask_token_id, pitfall=14, key="mask_token_id"), edge="block")
        positions = self.tensors.get("drafter_kwarg.position_ids")
        if positions is not None:
            self.account("drafter_kwarg.position_ids", "the drafter's position ids (context, then the blocks)")
            readable = positions.dim() and positions.numel()
            flat = positions.reshape(-1, positions.shape[-1])[0] if readable else positions.reshape(-1)
            block_pos = flat[-len(row):].tolist()
            whole = not (positions.is_floating_point() or positions.dtype == torch.bool)
            if not readable or not whole or len(block_pos) < len(row):
                self.account("drafter_kwarg.position_ids", f"position ids of shape {list(positions.shape)} "
                             f"({positions.dtype}), not whole positions for the {len(row)} block tokens: not read as "
                             "the blocks' positions")
                return info
            anchors = [block_pos[s] for s in starts]
            info["anchors"] = anchors
            bad = [j for j, s in enumerate(starts) if block_pos[s:s + length] != list(range(anchors[j],
                                                                                          anchors[j] + length))
                   and s + length <= len(row)]
            tokens = self.cands.tokens[0].tolist()
            wrong_anchor = [j for j, a in enumerate(anchors) if a not in range(len(tokens)) or tokens[a] != row[starts[j]]]
            if bad:
                self.add(Finding("positions", "divergence", f"block {bad[0]}'s positions are {block_pos[starts[bad[0]]:starts[bad[0]] + length]}; "
                                 f"the reference places a block at its anchor's position onward", None, None,
                                 pitfall=12, key="block_positions"), edge="block")
            elif wrong_anchor:
                j = wrong_anchor[0]
                self.add(Finding("anchors", "divergence", f"block {j} starts with token {row[starts[j]]} at position "
                                 f"{anchors[j]}, where the data holds another token: the anchor is not the token at "
                                 "its position", None, None, pitfall=8, key="anchor_token"), edge="block")
            seq = len(tokens)
            late = [a for a in anchors if a + length > seq]
            if late:
                self.add(Finding("anchors", "divergence", f"anchors {late} leave no room for a whole block in "
                                 f"{seq} tokens (the reference excludes the last {length} positions)", late, None,
                                 pitfall=8, key="late_anchors"), edge="block")
        mask = self.tensors.get("drafter_kwarg.attention_mask")
        if mask is not None and "anchors" in info:
            if mask.dim() < 2 or mask.numel() == 0 or mask.shape[-1] < mask.shape[-2]:
                self.account("drafter_kwarg.attention_mask", f"an attention mask of shape {list(mask.shape)}, not "
                             "[queries, context + queries]: not read as the training mask")
                return info
            self.account("drafter_kwarg.attention_mask", "the drafter's training mask")
            self.training_mask(mask, info)
        return info

    def training_mask(self, mask: torch.Tensor, info: dict) -> None:
        visible = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0]
        if visible.dtype != torch.bool:
            visible = visible > -1  # an additive mask: 0 visible, -inf hidden
        q = visible.shape[0]
        context = visible.shape[1] - q
        length = info["length"]
        for j, a in enumerate(info["anchors"]):
            rows = visible[info["anchor_slots"][j]:info["anchor_slots"][j] + length]
            seen = rows[:, :context].any(0).nonzero().flatten().tolist()
            if seen != list(range(min(a, context))):
                self.add(Finding("training_mask", "divergence",
                                 f"block {j} (anchor at {a}) sees context positions "
                                 f"{seen[:3]}...{seen[-1:] if seen else ''}; the reference: every position before "
                                 "its anchor, strictly", None, None, pitfall=9, key="context"), edge="block")
                return
            other = rows[:, context:].clone()
            own = slice(info["anchor_slots"][j], info["anchor_slots"][j] + length)
            other[:, own] = False
            if other.any():
                self.add(Finding("training_mask", "divergence", f"block {j}'s queries see another block's "
                                 "tokens; the reference lets a block see only itself", None, None, pitfall=9,
                                 key="cross_block"), edge="block")
                return

    # -- fc's inputs ---------------------------------------------------------------------------------------------
    def context_features(self) -> None:
        hidden = self.hidden_size
        for name in self.of_role("drafter_input"):
            if name in self.rows:
                continue
            t = self.tensors[name]
            if t.shape[-1] % hidden:
                continue
            rows = _rows(t)
            chunks = [name_rows(rows[:, k * hidden:(k + 1) * hidden], self.cands.hidden, self.tol(name))
                      for k in range(t.shape[-1] // hidden)]
            if not all(c.equal or c.noisy for c in chunks):
                worst = max(chunks, key=lambda c: c.distance)
                self.account(name, worst.describe(), worst.distance)
                continue
            module = self.entries[name].get("module", "?")
            layers = [c.candidate.layer for c in chunks]
            what = ", ".join(c.candidate.name for c in chunks)
            self.account(name, f"the context features fc reads ({module}): {what}",
                         max(c.distance for c in chunks))
            self.flow["fc_layers"] = layers
            self.flow["fc_module"] = module
            self.fc_finding(layers, chunks)
            noisy = [c for c in chunks if c.noisy]
            if noisy:
                c = max(noisy, key=lambda c: c.relative_noise)
                self.add(Finding("noise", "info", f"the drafter's context features carry noise: {c.describe()} "
                                 "— augmentation of the drafter's inputs, which the reference allows (targets stay "
                                 "clean)", round(c.residual_std, 4), "noise on inputs only", pitfall=15,
                                 key="inputs", raw={"relative": c.relative_noise}))

    def fc_finding(self, layers: list[int | None], chunks: list[Named]) -> None:
        ref = self.ref.layer_ids
        declared = self.drafter_facts.get("target_layer_ids")
        said = f" (the drafter's config declares {declared})" if declared is not None and declared != layers else ""
        read = ", ".join(str(x) for x in layers)
        want = ", ".join(str(x) for x in ref)
        if not ref or layers == ref:
            return
        if len(layers) != len(ref):
            missing = [x for x in ref if x not in layers]
            self.add(Finding("fc_dims", "divergence",
                             f"fc reads hidden_states of target layers {read} ({len(layers)} layers); {self.ref.layer_source} "
                             f"reads {want}{said}: fc is fed {len(layers)} of {len(ref)}"
                             + (f", without layer {', '.join(map(str, missing))}" if missing else ""),
                             layers, ref, pitfall=4, key="fc_layers"), edge="fc")
        elif all(a is not None and a - b == layers[0] - ref[0] for a, b in zip(layers, ref)) and \
                abs(layers[0] - ref[0]) == 1:
            self.add(Finding("target_layers", "divergence", f"fc reads hidden_states of target layers {read}, each "
                             f"one {'above' if layers[0] > ref[0] else 'below'} {want} ({self.ref.layer_source}): "
                             "the layer id read as hs[id] instead of hs[id + 1] or the reverse", layers, ref,
                             pitfall=2, key="fc_layers"), edge="fc")
        else:
            self.add(Finding("target_layers", "divergence", f"fc reads hidden_states of target layers {read}; "
                             f"{self.ref.layer_source} reads {want}{said}", layers, ref, pitfall=1,
                             key="fc_layers"), edge="fc")

    # -- the draft logits and the loss --------------------------------------------------------------------------
    def draft_slots(self, block: dict | None) -> dict | None:
        names = self.of_role("draft_logits")
        if not names:
            return None
        name = names[0]
        for other in names[1:]:
            self.account(other, "another head output carrying gradient")
        self.account(name, "the draft logits (the head's output on the drafter's hidden states)")
        logits = self.tensors[name]
        return {"name": name, "rows": centered_log_probs(_rows(logits)), "per_batch": logits.reshape(
            -1, logits.shape[-1]).shape[0] // max(1, logits.shape[0] if logits.dim() > 2 else 1),
            "batch": logits.shape[0] if logits.dim() > 2 else 1}

    def loss_side(self, block: dict | None, slots: dict | None) -> None:
        vocab = self.vocab
        inputs = self.of_role("loss_input")
        draft_side = self.of_role("loss_draft_side")
        distributions = [n for n in inputs if self.tensors[n].is_floating_point() and
                         self.tensors[n].dim() and self.tensors[n].shape[-1] == vocab]
        labels = [n for n in inputs if not self.tensors[n].is_floating_point() and self.tensors[n].dtype != torch.bool
                  and (str(self.entries[n].get("node", "")).startswith("NllLoss")
                       or self.entries[n].get("attr") == "target")]
        scalars = [n for n in inputs if self.tensors[n].numel() == 1]
        weights = [n for n in inputs if n not in distributions and n not in labels and n not in scalars
                   and self.tensors[n].is_floating_point()]
        narrow = [n for n in draft_side if self.tensors[n].shape[-1] != vocab]
        for n in narrow:
            self.account(n, f"a draft-side tensor of the loss {self.tensors[n].shape[-1]} wide, not the vocabulary's "
                            f"{vocab}: not read as log-probabilities")
        draft_side = [n for n in draft_side if n not in narrow]
        for n in draft_side:
            self.account(n, "the draft side of the loss (log-probabilities of the draft logits)")
        if not draft_side:
            self.findings.append(Finding("loss", "warning", "no draft-side tensor of the vocabulary's width was found "
                                         "in the loss's graph: the loss is not audited", None, None, key="unread"))
            return
        draft = _rows(self.tensors[draft_side[0]])
        mapping = self.slot_mapping(draft, slots, block)
        self.flow["loss_rows"] = draft.shape[0]
        for n in distributions:
            self.targets(n, mapping, block)
        factors = [n for n in weights if self.tensors[n].numel() == draft.shape[0]]
        weighed = torch.ones(draft.shape[0], dtype=torch.bool)  # rows the loss weighs 0 carry no label to read
        for n in factors:
            weighed &= self.tensors[n].flatten() != 0
        label_source = None
        for n in labels:
            label_source = self.labels(n, draft, mapping, block, weighed)
        for n in weights:
            if n not in factors:
                self.account(n, f"a constant of the loss (node {self.entries[n].get('node', '?')})")
        w = self.weights(factors, mapping, draft.shape[0]) if factors else None
        for n in scalars:
            self.account(n, f"a scalar of the loss's reduction (node {self.entries[n].get('node', '?')}, "
                            f"value {float(self.tensors[n].flatten()[0]):.6g})")
        self.loss_kind(draft, distributions[0] if distributions else None, labels[0] if labels else None,
                       label_source, w, mapping)

    def slot_mapping(self, draft: torch.Tensor, slots: dict | None, block: dict | None) -> dict | None:
        """Each loss row's draft slot: (batch row, block, slot in block), found by value in the draft logits."""
        if slots is None or block is None:
            return None
        rows = centered_log_probs(draft)
        table = slots["rows"]
        if rows.shape[-1] != table.shape[-1]:
            return None  # the loss's draft side is not of the draft logits' width: no row is a slot's
        index = torch.cdist(rows, table).argmin(1)
        distance = float((rows - table[index]).abs().max())
        if distance > 1e-2:
            return None
        per = block["ids"].shape[-1]
        length = block["length"]
        mapping = []
        for i in index.tolist():
            b, s = divmod(i, per)
            starts = block["anchor_slots"]
            j = max(k for k, st in enumerate(starts) if st <= s)
            mapping.append((b, j, s - starts[j]))
        return {"slots": mapping, "length": length}

    def expected_position(self, b: int, j: int, k: int, block: dict) -> int | None:
        anchors = block.get("anchors")
        if anchors is None or j >= len(anchors) or anchors[j] is None:
            return None
        from_anchor = bool(self.drafter_facts.get("sample_from_anchor", False))
        return b * self.cands.seq_len + anchors[j] + k - (0 if from_anchor else 1)

    def targets(self, name: str, mapping: dict | None, block: dict | None) -> Named:
        rows = centered_log_probs(_rows(self.tensors[name]))
        named = name_rows(rows, self.cands.log_probs(), self.tol(name))
        self.account(name, f"the targets: {named.describe()}", named.distance)
        ref = self.cands.reference_logits
        self.flow["targets"] = named.candidate.name if named.candidate else None
        if named.candidate is not None and named.candidate != ref and (named.equal or named.noisy):
            c = named.candidate
            what = "its final norm never applied" if not c.normed else \
                "the final norm applied twice" if "twice" in c.name else \
                f"layer {c.layer} instead of the final layer {self.cands.layers - 1}"
            self.add(Finding("targets", "divergence", f"the target logits equal {c.name}; the reference distils "
                             f"hidden_states[-1], the final layer {self.cands.layers - 1} after its norm (the target's "
                             f"own logits): {what}", c.name, ref.name, pitfall=3, key="target_source"),
                     edge="targets")
        elif not (named.equal or named.noisy):
            self.add(Finding("unexplained", "warning", f"the target distribution {name} (shape "
                             f"{self.entries[name]['shape']}) is no candidate: {named.describe()}", None, None,
                             key=name), edge="targets")
            return named
        if named.noisy:
            self.add(Finding("noise", "divergence", f"the targets carry noise: they equal {named.candidate.name} plus a "
                             f"residual no candidate explains, std {named.residual_std:.3g} ({named.relative_noise:.2g} "
                             "of the clean logits' std); the reference computes targets from clean target states "
                             "(noise belongs on the drafter's inputs only)", round(named.residual_std, 4), 0.0,
                             pitfall=15, key="targets", raw={"relative": named.relative_noise}), edge="targets")
        if mapping is not None and block is not None and named.positions is not None:
            if "anchors" not in block:
                self.infer_anchors(named.positions.tolist(), mapping, block)
            self.alignment(named.positions.tolist(), mapping, block)
        return named

    def infer_anchors(self, found: list[int], mapping: dict, block: dict) -> None:
        """No position ids recorded: each block's anchor from where its first trained slot's target sits, the one
        shift under which every block's first token is the data's token at its anchor."""
        seq = self.cands.seq_len
        tokens = self.cands.tokens.flatten().tolist()
        row = block["ids"].flatten().tolist()
        first = {}
        for pos, (b, j, k) in zip(found, mapping["slots"]):
            if k == 1:
                first[(b, j)] = pos
        fits = []
        for shift in range(-2, 3):
            anchors = {key: pos - shift - key[0] * seq for key, pos in first.items()}
            if anchors and all(a in range(seq) and tokens[b * seq + a] == row[b * len(row) // max(1, block["ids"].shape[0])
                                                                               + block["anchor_slots"][j]]
                               for (b, j), a in anchors.items()):
                fits.append(anchors)
        if len(fits) == 1:
            by_block = {j: a for (b, j), a in fits[0].items() if b == 0}
            block["anchors"] = [by_block.get(j) for j in range(len(block["anchor_slots"]))]
            block["anchors_from"] = "the targets' positions"

    def alignment(self, found: list[int], mapping: dict, block: dict) -> None:
        shifts = Counter()
        for pos, (b, j, k) in zip(found, mapping["slots"]):
            expected = self.expected_position(b, j, k, block)
            if expected is not None:
                shifts[pos - expected] += 1
        if not shifts:
            return
        shift, count = shifts.most_common(1)[0]
        self.flow["target_shift"] = shift
        if shift != 0 and count >= sum(shifts.values()) / 2:
            self.add(Finding("target_alignment", "divergence",
                             f"the targets are shifted by {shift:+d}: slot k of the block at anchor a is trained "
                             f"toward the target's logits at position a + k{f'{shift - 1:+d}' if shift != 1 else ''}; the reference (DFlash, "
                             "sample_from_anchor false) takes them at a + k - 1", shift, 0, pitfall=5,
                             key="shift", raw={"rows": dict(shifts)}), edge="targets")

    def labels(self, name: str, draft: torch.Tensor, mapping: dict | None, block: dict | None,
               weighed: torch.Tensor) -> str | None:
        labels = self.tensors[name].flatten()
        if mapping is None or block is None or labels.numel() != len(mapping["slots"]):
            self.account(name, "hard labels (their positions unknown: no block mapping)")
            return None
        tokens = self.cands.tokens.flatten()
        options: dict[str, list[int]] = {}
        expected = [self.expected_position(b, j, k, block) for b, j, k in mapping["slots"]]
        if any(e is None for e in expected):
            self.account(name, "hard labels (positions unknown)")
            return None
        for shift in (0, 1, -1):
            options[f"the data's next tokens{'' if not shift else f' (shifted by {shift:+d})'}"] = [
                int(tokens[e + 1 + shift]) if e + 1 + shift in range(tokens.numel()) else -1 for e in expected]
            for c, logits in self.cands.logits.items():
                top = logits.argmax(-1)
                options[f"the argmax of {c.name}{'' if not shift else f' (shifted by {shift:+d})'}"] = [
                    int(top[e + shift]) if e + shift in range(top.numel()) else -1 for e in expected]
        kept = weighed.tolist() if weighed.numel() == labels.numel() and weighed.any() else [True] * labels.numel()
        truth = [t for t, k in zip(labels.tolist(), kept) if k]
        options = {option: [v for v, k in zip(values, kept) if k] for option, values in options.items()}
        scored = sorted(((sum(a == b for a, b in zip(truth, v)) / len(truth), k) for k, v in options.items()),
                        reverse=True)
        share, best = scored[0]
        self.account(name, f"hard labels: {best} ({share:.0%} of {len(truth)} rows)", 1 - share)
        return best if share == 1.0 else None

    def weights(self, names: list[str], mapping: dict | None, rows: int) -> torch.Tensor:
        """The per-row weights: the product of every per-row constant the loss multiplies in (decay, mask)."""
        w = torch.ones(rows)
        for name in names:
            w = w * self.tensors[name].float().flatten()
        if mapping is None:
            for name in names:
                self.account(name, "a factor of the per-position loss weights (slots unknown)")
            return w
        per_slot: dict[int, list[float]] = {}
        for value, (_, _, k) in zip(w.tolist(), mapping["slots"]):
            per_slot.setdefault(k, []).append(value)
        # Rows of weight 0 are masked out (padding, invalid anchors): the weighting is read from the others.
        kept = {k: [x for x in v if x != 0] for k, v in per_slot.items()}
        means = {k: sum(v) / len(v) if v else 0.0 for k, v in sorted(kept.items())}
        spread = max((max(v) - min(v) for v in kept.values() if v), default=0.0)
        fit = fit_weights(means)
        self.flow["weights"] = fit["text"]
        for name in names:
            own = fit_weights(slot_means(self.tensors[name].float().flatten(), mapping))["text"]
            self.account(name, f"a factor of the per-position loss weights ({own}); all factors together: "
                               f"{fit['text']}")
        if spread > 1e-6 * max(abs(x) for x in w.tolist()):
            self.findings.append(Finding("loss_weights", "warning", f"the loss weights vary between blocks at the same "
                                         f"slot (by {spread:.3g}): a per-block weighting (D-PACE?) or a mask, not "
                                         "fitted", None, None, pitfall=18, key="per_block"))
        if means.get(0, 0.0) > 0:
            self.add(Finding("loss_weights", "divergence", f"the anchor slot (slot 0) is trained with weight "
                             f"{means[0]:.3g}; the reference gives it 0 (it is the input, not a prediction)",
                             means[0], 0.0, pitfall=6, key="anchor_slot"), edge="loss")
        self.fitted = fit
        return w

    def loss_kind(self, draft, distribution: str | None, labels: str | None, label_source: str | None,
                  w: torch.Tensor | None, mapping: dict | None) -> None:
        recorded = float(self.meta["loss"])
        logq = torch.log_softmax(draft.float(), -1)
        rows = logq.shape[0]
        weights = w if w is not None else torch.ones(rows)
        batch = [b for b, _, _ in mapping["slots"]] if mapping else [0] * rows
        kinds: dict[str, torch.Tensor] = {}
        if distribution is not None:
            p_log = torch.log_softmax(_rows(self.tensors[distribution]).float().clamp_min(-1e30), -1)
            t = self.tensors[distribution].float()
            if t.min() >= 0 and torch.allclose(t.sum(-1), torch.ones_like(t.sum(-1)), atol=1e-3):
                p_log = _rows(t).clamp_min(1e-30).log()
            p = p_log.exp()
            kinds["kl_div"] = (p * (p_log - logq)).sum(-1)
            kinds["ce"] = -logq.gather(1, p_log.argmax(-1, keepdim=True)).squeeze(1)
        if labels is not None:
            ids = self.tensors[labels].flatten().long()
            kinds["ce toward the recorded labels"] = -logq.gather(1, ids[:, None]).squeeze(1)
        matches = []
        for kind, per_row in kinds.items():
            for reduction, value in reductions(per_row, weights, batch):
                if abs(value - recorded) <= 1e-4 * max(1.0, abs(recorded)):
                    matches.append((kind, reduction))
        self.flow["loss"] = f"{recorded:.6g}"
        if not matches:
            self.findings.append(Finding("loss", "warning", f"the recorded loss {recorded:.6g} is none of "
                                         f"{', '.join(kinds)} under the reductions tried", recorded, None,
                                         pitfall=7, key="unrecognized"))
            self.recipe_findings(None, label_source)
            return
        kind, reduction = matches[0]
        self.flow["loss_kind"] = f"{kind}, {reduction}"
        if reduction != REFERENCE_REDUCTION:
            self.add(Finding("loss_weights", "divergence", f"the loss is reduced as {reduction}; the reference reduces "
                             f"as {REFERENCE_REDUCTION}", reduction, REFERENCE_REDUCTION, pitfall=6,
                             key="reduction"), edge="loss")
        self.recipe_findings(kind, label_source)

    def recipe_findings(self, kind: str | None, label_source: str | None) -> None:
        """The recipe found (loss kind, weighting, gamma) against speculators' reference recipe for it."""
        from reference_adapters.speculators_recipe import yardstick_for

        fit = getattr(self, "fitted", None)
        found: dict[str, Any] = {}
        unknown = set()
        from_data = label_source is not None and label_source.startswith("the data")
        if kind == "kl_div":
            found["loss_fn"] = "kl_div"
        elif kind == "ce" or (kind and label_source and "argmax" in label_source):
            found["loss_fn"] = "ce"
        else:
            unknown.add("loss_fn")  # CE toward the data's tokens is no speculators setting: it decides nothing
        if fit and fit["kind"] == "fixed-exp-decay":
            found["per_position_loss_weight"], found["gamma"] = "fixed-exp-decay", fit["gamma"]
        elif fit and fit["kind"] == "uniform":
            found["per_position_loss_weight"] = "uniform"
        else:
            unknown.add("per_position_loss_weight")
        recipe = Recipe(**{k: v for k, v in found.items() if (k, v) != ("per_position_loss_weight", "uniform")})
        reference, why = yardstick_for(recipe, unknown)
        ref = reference.recipe
        self.flow["reference"] = reference.title
        if from_data:
            self.add(Finding("recipe", "divergence", f"loss_fn: cross-entropy toward the data's next tokens; "
                             f"{reference.title} distils the target ({ref.loss_fn}: "
                             f"{'its argmax' if ref.loss_fn == 'ce' else 'its logits'}) — the drafter learns the "
                             "data, not what the target would accept", "ce (data labels)", ref.loss_fn,
                             pitfall=RECIPE_ENTRIES["loss_fn"][0], key="loss_fn"), edge="loss")
        elif "loss_fn" in found and found["loss_fn"] != ref.loss_fn:
            pitfall, severity, consequence = RECIPE_ENTRIES["loss_fn"]
            self.add(Finding("recipe", severity, f"loss_fn: {found['loss_fn']} vs {ref.loss_fn} in {reference.title} "
                             f"({why}) — {consequence}", found["loss_fn"], ref.loss_fn, pitfall=pitfall,
                             key="loss_fn"), edge="loss")
        weighting = found.get("per_position_loss_weight")
        if weighting and weighting != ref.per_position_loss_weight:
            pitfall, severity, consequence = RECIPE_ENTRIES["per_position_loss_weight"]
            self.add(Finding("recipe", severity, f"per_position_loss_weight: the weights are {fit['text']}; "
                             f"{reference.title} uses {ref.per_position_loss_weight} — {consequence}", weighting,
                             ref.per_position_loss_weight, pitfall=pitfall, key="per_position_loss_weight"),
                     edge="loss")
        elif weighting == "fixed-exp-decay" and not math.isclose(found["gamma"], ref.gamma, rel_tol=1e-3):
            pitfall, severity, consequence = RECIPE_ENTRIES["gamma"]
            self.add(Finding("recipe", severity, f"gamma: the weights fit exp(-(k-1)/{found['gamma']:.4g}) to "
                             f"{fit['error']:.1g}: gamma {found['gamma']:.4g} vs {ref.gamma:g} in {reference.title} — "
                             f"{consequence}", round(found["gamma"], 4), ref.gamma, pitfall=pitfall, key="gamma"),
                     edge="loss")


def audit_recording(recording: Recording, target_dir: Path | None = None, ref: Path | None = None,
                    placement=None) -> TraceReport:
    """Every recorded step audited; a finding seen at several steps is reported once (its first step's numbers)."""
    from foundation.placement import CPU_FLOAT32, Placement
    from foundation.target import load_target_model

    steps = recording.steps
    target_meta = steps[0]["target"]
    target_path = Path(target_dir) if target_dir is not None else Path(target_meta["path"])
    if not (target_path / "config.json").is_file():
        raise AuditError(f"--target {target_path}: no Hugging Face model folder there (the recorded target was "
                         f"{target_meta['path']!r}; name its folder with --target)")
    ref_data = read_ref(ref)
    if placement is None:  # the target rerun in the dtype it ran in, so "equal" means one kernel's rounding
        import torch

        dtype = getattr(torch, str(target_meta.get("dtype", "float32")), torch.float32)
        placement = CPU_FLOAT32 if dtype == torch.float32 else Placement(torch.device("cpu"), dtype, "the recording")
    target = load_target_model(target_path, placement)
    pad_id = target.config.pad_token_id
    findings: list[Finding] = []
    rows: list[TensorRow] = []
    seen: set[tuple[str, str]] = set()
    flow: dict[str, Any] = {}
    vocab = target.config.vocab_size
    for index, meta in enumerate(steps):
        tensors = recording.step_tensors(index)
        for name, entry in meta["entries"].items():  # token ids index the target's embedding: in its vocabulary
            if entry["role"] in ID_ROLES and bool(outside_vocabulary(tensors[name], vocab).any()):
                raise AuditError(f"--from {recording.folder}: step {index}'s {name!r} holds token ids "
                                 f"{int(tensors[name].min())}..{int(tensors[name].max())}, outside the target's "
                                 f"vocabulary of {vocab} (not a recording of this target; record it again)")
        tokens = [tensors[n] for n, e in meta["entries"].items() if e["role"] == "tokens"]
        if not tokens:
            raise AuditError(f"--from {recording.folder}: step {index} recorded no token ids")
        cands = TargetCandidates(target, tokens[0].reshape(-1, tokens[0].shape[-1]))
        reference = reference_for(meta["drafter"]["facts"], cands.layers, ref_data)
        audit = StepAudit(meta, tensors, cands, reference, pad_id, index)
        audit.run()
        for f in audit.findings:
            if (f.component, f.key) not in seen:
                seen.add((f.component, f.key))
                findings.append(f)
        rows.extend(audit.rows.values())
        if index == 0:
            flow = {**audit.flow, "divergent": sorted(audit.flow["divergent"]), "target_layers": cands.layers,
                    "reference_layers": reference.layer_ids, "reference_source": reference.layer_source}
            facts = {"target": target_meta, "drafter": meta["drafter"], "reference": reference.__dict__,
                     "loss": meta["loss"], "steps": len(steps), "context": recording.manifest.get("context", {}),
                     "recording": str(recording.folder)}
    return TraceReport(sort_findings(findings), rows, facts, flow)
