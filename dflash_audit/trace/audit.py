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
from dflash_audit.trace.loss_fit import REFERENCE_REDUCTION, fit_weights
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
        ids, source = [], "unknown: the drafter declares no depth and no --ref was given"
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


LOOSE_GRADIENT = 1e-4  # targets read back from the loss's gradient (g / c, then log): a few float32 roundings


def micro_batch(name: str) -> str:
    """The micro-batch a recorded tensor belongs to: its `mb<n>.` prefix (the step's first: none)."""
    head = name.split(".", 1)[0]
    return head if head.startswith("mb") and head[2:].isdigit() else ""


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
        self.notes: list[str] = []
        self.blocks: dict[int, dict] = {}  # drafter call -> its block tokens, slots, positions, mask
        self.mask_id: int | None = None
        self.block_length: int | None = None
        self.draft_rows: torch.Tensor | None = None
        self.draft_slots: list = []
        self.draft_prefix: list[str] = []  # each draft row's micro-batch

    def tol(self, name: str) -> float:
        return tolerance(self.entries[name]["dtype"])

    def account(self, name: str, what: str, distance: float | None = None) -> None:
        e = self.entries[name]
        self.rows[name] = TensorRow(self.step, name, e["role"], e["shape"], str(e.get("device", "?")), what,
                                     distance)

    def of_role(self, role: str) -> list[str]:
        return [n for n, e in self.entries.items() if e["role"] == role]

    def add(self, finding: Finding, edge: str | None = None) -> None:
        if any((f.component, f.key) == (finding.component, finding.key) for f in self.findings):
            return  # one root cause is one finding, however many calls or tensors show it
        self.findings.append(finding)
        if edge and finding.severity == "divergence":
            self.flow["divergent"].add(edge)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # ----------------------------------------------------------------------------------------------------------
    def run(self) -> None:
        for name in self.of_role("tokens"):
            self.account(name, "the target's input ids (the candidates are recomputed from them)")
        for name in self.of_role("target_attention_mask"):
            self.account(name, "the target's attention mask (the target is rerun with it)")
        for name in self.of_role("target_position_ids"):
            self.account(name, "the target's position ids (the target is rerun with them)")
        self.block_tokens()
        self.context_features()
        self.draft_table()
        self.loss_side()
        for name in self.entries:
            if name not in self.rows:
                e = self.entries[name]
                self.account(name, "unexplained: no candidate and no role in the loss")
                self.add(Finding("unexplained", "warning", f"{name} ({e['role']}, shape {e['shape']}) is no tensor "
                                 "the audit can name: no candidate of the target equals it", None, None, key=name))

    # -- the blocks: every drafter call's block token ids, wherever they sit -------------------------------------
    def block_tokens(self) -> None:
        """Each drafter call's block token ids (the ids whose embedding it consumed: the same tensor, or equal by
        value), then their mask id, block length and anchor slots read from the ids themselves."""
        fed = {n: self.tensors[n] for n in self.of_role("drafter_input")}
        by_call: dict[int, tuple[str, torch.Tensor]] = {}
        for name in self.of_role("embedding_ids"):
            ids = self.tensors[name]
            consumed = self.entries[name].get("consumed_as")
            consumed = [consumed] if consumed in fed else []
            if not consumed:
                emb = self.cands.embed(ids)
                consumed = [n for n, t in fed.items() if t.shape == emb.shape and n not in self.rows and
                            float((t.float() - emb).abs().max()) <= self.tol(n) * float(emb.abs().max())]
            if not consumed:
                self.account(name, "ids embedded outside the target's forward, not consumed by the drafter")
                continue
            for n in consumed:
                self.account(n, f"the target's embedding of the block tokens ({name})", 0.0)
            call = self.entries[consumed[0]].get("call", 0)
            by_call.setdefault(call, (name, ids))
        if not by_call:
            return
        every = torch.cat([ids.flatten() for _, ids in by_call.values()]).tolist()
        mask_id = Counter(every).most_common(1)[0][0]
        gaps, spans = Counter(), Counter()
        for _, ids in by_call.values():
            for row in ids.reshape(-1, ids.shape[-1]).tolist():
                starts = [i for i, t in enumerate(row) if t != mask_id]
                gaps.update(b - a for a, b in zip(starts, starts[1:]))
                if len(starts) == 1:
                    spans[len(row) - starts[0]] += 1
        length = (gaps or spans).most_common(1)[0][0] if (gaps or spans) else None
        if not length:
            return
        self.mask_id, self.block_length = mask_id, length
        count = 0
        for call, (name, ids) in sorted(by_call.items()):
            rows = ids.reshape(-1, ids.shape[-1])
            slots = []  # per token of the call: (row, block, slot) or None
            for b, row in enumerate(rows.tolist()):
                starts = [i for i, t in enumerate(row) if t != mask_id]
                for i in range(len(row)):
                    j = max((n for n, s in enumerate(starts) if s <= i), default=None)
                    k = i - starts[j] if j is not None else None
                    slots.append((b, j, k) if j is not None and k < length else None)
            anchors = {(b, j): row[s] for b, row in enumerate(rows.tolist())
                       for j, s in enumerate(i for i, t in enumerate(row) if t != mask_id)}
            count += len(anchors)
            self.blocks[call] = {"name": name, "ids": rows, "slots": slots, "anchor_tokens": anchors}
            self.account(name, f"block tokens (drafter call {call}): anchor + mask id {mask_id}, blocks of {length}")
            self.block_positions(call)
        self.flow["blocks"] = count
        self.block_findings()

    def block_findings(self) -> None:
        length, mask_id = self.block_length, self.mask_id
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

    def call_kwarg(self, call: int, kwarg: str) -> str | None:
        found = [n for n in self.of_role("drafter_kwarg") if self.entries[n].get("kwarg") == kwarg and
                 self.entries[n].get("call", call) == call]
        return found[0] if found else None

    def block_positions(self, call: int) -> None:
        """The block's position ids (the call's last positions, one per block token): each block's positions run
        on from its anchor's. Where its anchor sits in the data is read by value later, never from these."""
        block = self.blocks[call]
        name = self.call_kwarg(call, "position_ids")
        if name is None:
            return
        positions = self.tensors[name]
        whole = not (positions.is_floating_point() or positions.dtype == torch.bool)
        rows = block["ids"]
        width = rows.shape[-1]
        if not whole or positions.dim() == 0 or positions.shape[-1] < width:
            self.account(name, f"position ids of shape {list(positions.shape)} ({positions.dtype}): not read as the "
                               "blocks' positions")
            return
        self.account(name, f"the drafter's position ids (drafter call {call}): its context's, then the blocks'")
        flat = positions.reshape(-1, positions.shape[-1])[:, -width:]
        block["positions"] = {}
        for b in range(rows.shape[0]):
            pos = flat[b if b < flat.shape[0] else 0].tolist()
            by_block: dict[int, list[int]] = {}
            for i, slot in enumerate(block["slots"][b * width:(b + 1) * width]):
                if slot is not None:
                    by_block.setdefault(slot[1], []).append(pos[i])
            for j, seen in by_block.items():
                block["positions"][(b, j)] = seen[0]
                if seen != list(range(seen[0], seen[0] + len(seen))):
                    self.add(Finding("positions", "divergence", f"a block's positions are {seen}; the reference "
                                     "places a block at its anchor's position onward", None, None, pitfall=12,
                                     key="block_positions"), edge="block")
        mask = self.call_kwarg(call, "attention_mask")
        if mask is not None:
            block["mask"] = mask

    def training_mask(self, mask: torch.Tensor, block: dict, anchors: dict, call: int) -> None:
        """A call holding the whole sequence as context and a hand-built mask: each block sees the context before
        its anchor, strictly, and no other block."""
        name = block["mask"]
        if mask.dim() < 2 or mask.numel() == 0 or mask.shape[-1] < mask.shape[-2]:
            self.account(name, f"an attention mask of shape {list(mask.shape)}, not [queries, context + queries]: "
                               "not read as the training mask")
            return
        visible = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0]
        if visible.dtype != torch.bool:
            visible = visible > -1  # an additive mask: 0 visible, -inf hidden
        q = visible.shape[0]
        context = visible.shape[1] - q
        width = block["ids"].shape[-1]
        if q != width or context != self.cands.seq_len:
            self.account(name, f"the drafter's attention mask (drafter call {call}; its context is not the whole "
                               "sequence: not read as the training mask)")
            return
        self.account(name, f"the drafter's training mask (drafter call {call})")
        for (b, j), a in sorted(anchors.items()):
            if b != 0:
                continue
            rows = [i for i, s in enumerate(block["slots"][:width]) if s is not None and s[1] == j]
            seen = visible[rows, :context].any(0).nonzero().flatten().tolist()
            if seen != list(range(min(a, context))):
                self.add(Finding("training_mask", "divergence",
                                 f"block {j} (anchor at {a}) sees context positions "
                                 f"{seen[:3]}...{seen[-1:] if seen else ''}; the reference: every position before "
                                 "its anchor, strictly", None, None, pitfall=9, key="context"), edge="block")
                return
            other = visible[rows, context:].clone()
            other[:, rows] = False
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
        if not ref:
            self.note(f"fc reads target layers {read}; the reference's layer ids are {self.ref.layer_source}: not "
                      "checked (give --ref a config declaring target_layer_ids)")
            return
        if layers == ref:
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
    # -- the draft rows and the loss ----------------------------------------------------------------------------
    def draft_table(self) -> None:
        """Every draft-logit row of every call, with the block slot it drafts (its call's block token at the same
        place), as centred log-probabilities to find the loss's rows in by value."""
        rows, slots = [], []
        for name in self.of_role("draft_logits"):
            logits = self.tensors[name]
            call = self.entries[name].get("call")
            block = self.blocks.get(call)
            flat = _rows(logits)
            known = block is not None and len(block["slots"]) == flat.shape[0]
            self.account(name, "the draft logits (the head's output on the drafter's hidden states"
                         + (f", drafter call {call})" if known else "; their block slots unknown)"))
            rows.append(centered_log_probs(flat))
            self.draft_prefix.extend([micro_batch(name)] * flat.shape[0])
            slots.extend([(call, *s) if s is not None else None for s in block["slots"]] if known
                         else [None] * flat.shape[0])
        self.draft_rows = torch.cat(rows) if rows else None
        self.draft_slots = slots

    def slot_of(self, log_probs: torch.Tensor, prefix: str | None = None) -> list:
        """Each row's draft slot (call, batch row, block, slot), found by value among the draft logits."""
        if self.draft_rows is None or log_probs.shape[-1] != self.draft_rows.shape[-1]:
            return [None] * log_probs.shape[0]
        rows = centered_log_probs(log_probs)
        table, slots = self.draft_rows, self.draft_slots
        if prefix is not None:  # a micro-batch's loss rows are among its own draft rows
            own = [i for i, p in enumerate(self.draft_prefix) if p == prefix]
            if own:
                table, slots = table[own], [slots[i] for i in own]
        # The nearest few by the matrix-product shortcut, then their exact distances (the shortcut's rounding can
        # swap two near-equal slots' rows).
        near_few = torch.cdist(rows, table).topk(min(4, table.shape[0]), largest=False).indices
        exact = (rows[:, None, :] - table[near_few]).norm(dim=-1)
        best = exact.min(1).values
        used: set[int] = set()
        found = []
        for r in range(rows.shape[0]):  # equal draft rows (a drafter blind to position): the next one, in order
            ties = near_few[r][exact[r] <= best[r] + 1e-6 + 1e-4 * best[r]].tolist()
            i = next((t for t in ties if t not in used), ties[0])
            used.add(i)
            near = float((rows[r] - table[i]).abs().max()) <= 1e-2
            found.append(slots[i] if near else None)
        return found

    def loss_side(self) -> None:
        vocab = self.vocab
        for n in self.of_role("loss_draft_side"):
            self.account(n, "the draft side of the loss (log-probabilities of the draft logits)"
                         if self.tensors[n].shape[-1] == vocab else
                         f"a draft-side tensor of the loss {self.tensors[n].shape[-1]} wide")
        inputs = self.of_role("loss_input")
        distributions = [n for n in inputs if self.tensors[n].is_floating_point() and
                         self.tensors[n].dim() and self.tensors[n].shape[-1] == vocab]
        labels = [n for n in inputs if not self.tensors[n].is_floating_point() and self.tensors[n].dtype != torch.bool
                  and (str(self.entries[n].get("node", "")).startswith("NllLoss")
                       or self.entries[n].get("attr") == "target")]
        for n in inputs:
            if n not in distributions and n not in labels:
                t = self.tensors[n]
                value = f", value {float(t.flatten()[0]):.6g}" if t.numel() == 1 else ""
                self.account(n, f"a constant of the loss (node {self.entries[n].get('node', '?')}{value}; the "
                                "weights and the reduction are read from the loss's gradient)")
        # Each trained row: its weight c (reduction included) and its target p, from the loss's gradient.
        trained = []  # (slot, c, p row, log q row)
        for g_name in self.of_role("loss_gradient"):
            lq_name = self.entries[g_name].get("of")
            if lq_name not in self.tensors:
                continue
            g, lq = _rows(self.tensors[g_name]), _rows(self.tensors[lq_name])
            c = -g.sum(-1)
            self.account(g_name, f"the loss's gradient on {lq_name}: each row's weight and target")
            slots = self.slot_of(lq, micro_batch(g_name))
            top = float(c.abs().max()) if c.numel() else 0.0
            live_rows = (c.abs() > 1e-7 * top) if top else torch.zeros_like(c, dtype=torch.bool)
            targets = g / -torch.where(live_rows, c, torch.ones_like(c))[:, None]
            for r, (weight, on) in enumerate(zip(c.tolist(), live_rows.tolist())):
                if on:
                    trained.append((slots[r], weight, targets[r], lq[r]))
                elif slots[r] is not None:
                    trained.append((slots[r], 0.0, None, lq[r]))
        self.flow["loss"] = f"{float(self.meta['loss']):.6g}"
        if not trained:
            for n in distributions:
                self.targets(n)
            for n in labels:
                self.account(n, "hard labels (the loss's gradient was not recorded)")
            self.findings.append(Finding("loss", "warning", "the loss's gradient on the draft log-probabilities was "
                                         "not recorded: the weights and the loss are not audited", None, None,
                                         key="unread"))
            return
        live = [t for t in trained if t[1] > 0]
        self.flow["loss_rows"] = len(live)
        hard = bool(live) and all(float(p.max()) > 1 - 1e-4 for _, _, p, _ in live)
        positions = self.target_positions(live, distributions, hard)
        for n in labels:
            self.account(n, "hard labels (the targets are read from the loss's gradient)")
        label_source = self.label_source(live, positions) if hard else None
        anchors = self.anchors(live, positions or [None] * len(live))
        if anchors is not None:
            self.alignment(live, positions or [None] * len(live), anchors)
        self.weights(trained)
        self.loss_kind(live, trained, hard, label_source)

    def target_positions(self, live: list, distributions: list[str], hard: bool) -> list | None:
        """Each trained row's target named by value: the recorded target row equal to it (then that tensor is
        named: which candidate, at which position, plus what residual), or the gradient's own distribution."""
        if hard:
            return None
        tables = []
        if distributions:  # named together: one candidate for every target row (noise averages out over them)
            rows = [centered_log_probs(_rows(self.tensors[n])) for n in distributions]
            named = name_rows(torch.cat(rows), self.cands.log_probs(), min(self.tol(n) for n in distributions))
            for n in distributions:
                self.account(n, f"the targets: {named.describe()}", named.distance)
            self.target_findings(named, ", ".join(distributions) if len(distributions) < 3 else
                                 f"{distributions[0]} and {len(distributions) - 1} more")
            if (named.equal or named.noisy) and named.positions is not None:
                for n, part in zip(distributions, torch.split(named.positions, [r.shape[0] for r in rows])):
                    tables.append((n, centered_log_probs(_rows(self.tensors[n])).softmax(-1), part))
        positions: list[int | None] = [None] * len(live)
        if tables and live:
            wanted = torch.stack([p for _, _, p, _ in live])
            for n, probs, pos in tables:  # each row's recorded twin: the same distribution (L1 within 1e-3)
                distance, index = torch.cdist(wanted, probs, p=1).min(1)
                for r, (d, i) in enumerate(zip(distance.tolist(), index.tolist())):
                    if positions[r] is None and d <= 1e-3:
                        positions[r] = int(pos[i])
        if tables and all(x is not None for x in positions):
            return positions
        # No recorded tensor holds them (made in code the recorder cannot see): the gradient's own rows, named.
        stacked = torch.stack([p.clamp_min(1e-30).log() for _, _, p, _ in live])
        named = name_rows(centered_log_probs(stacked), self.cands.log_probs(), LOOSE_GRADIENT)
        self.target_findings(named, "the targets read from the loss's gradient")
        return named.positions.tolist() if named.positions is not None and (named.equal or named.noisy) else None

    def targets(self, name: str) -> Named | None:
        rows = centered_log_probs(_rows(self.tensors[name]))
        named = name_rows(rows, self.cands.log_probs(), self.tol(name))
        self.account(name, f"the targets: {named.describe()}", named.distance)
        self.target_findings(named, name)
        return named if named.equal or named.noisy else None

    def target_findings(self, named: Named, what: str) -> None:
        ref = self.cands.reference_logits
        self.flow.setdefault("targets", named.candidate.name if named.candidate else None)
        if named.candidate is not None and named.candidate != ref and (named.equal or named.noisy):
            c = named.candidate
            why = "its final norm never applied" if not c.normed else \
                "the final norm applied twice" if "twice" in c.name else \
                f"layer {c.layer} instead of the final layer {self.cands.layers - 1}"
            self.add(Finding("targets", "divergence", f"the target logits equal {c.name}; the reference distils "
                             f"hidden_states[-1], the final layer {self.cands.layers - 1} after its norm (the target's "
                             f"own logits): {why}", c.name, ref.name, pitfall=3, key="target_source"),
                     edge="targets")
        elif not (named.equal or named.noisy):
            self.add(Finding("unexplained", "warning", f"the targets are no candidate of the target ({what}): "
                             f"{named.describe()}", None, None, key="targets"), edge="targets")
            return
        if named.noisy:
            self.add(Finding("noise", "divergence", f"the targets carry noise ({what}): they equal "
                             f"{named.candidate.name} plus a residual no candidate explains, std "
                             f"{named.residual_std:.3g} ({named.relative_noise:.2g} of the clean logits' std); the "
                             "reference computes targets from clean target states (noise belongs on the drafter's "
                             "inputs only)", round(named.residual_std, 4), 0.0, pitfall=15, key="targets",
                             raw={"relative": named.relative_noise, "tensor": what}), edge="targets")

    def anchors(self, live: list, positions: list) -> dict | None:
        """Where each block's anchor sits in the data, by value: its position ids' anchor where the data holds the
        anchor's token there (for every block), else the one offset from the targets' positions under which every
        block's anchor token is the data's token there. Neither: unknown (said, never guessed)."""
        seq = self.cands.seq_len
        tokens = self.cands.tokens.reshape(-1).tolist()
        rows_of: dict[tuple, list[tuple[int, int]]] = {}
        batch = self.cands.tokens.reshape(-1, seq).shape[0]
        for (slot, _, _, _), pos in zip(live, positions):
            if slot is not None:
                call, b, j, k = slot
                rows_of.setdefault((call, b, j), []).append((k, pos))
        if not rows_of:
            return None
        token_of = {key: self.blocks[key[0]]["anchor_tokens"].get(key[1:]) for key in rows_of}
        row_of = {key: Counter(p // seq if p is not None else min(key[1], batch - 1) for _, p in rows).most_common(
            1)[0][0] for key, rows in rows_of.items()}
        given = {key: self.blocks[key[0]].get("positions", {}).get(key[1:]) for key in rows_of}
        if all(a is not None and a in range(seq) and tokens[row_of[key] * seq + a] == token_of[key]
               for key, a in given.items()):
            self.flow["anchors_from"] = "the drafter's position ids (the data's token at each)"
            return {key: row_of[key] * seq + a for key, a in given.items()}
        from_anchor = bool(self.drafter_facts.get("sample_from_anchor", False))
        if any(p is None for rows in rows_of.values() for _, p in rows):
            self.note("the anchors could not be told from the data (the targets' positions are unknown and the "
                      "position ids do not place every anchor token on the data's token)")
            return None
        for shift in (0, 1, -1, 2, -2):
            found = {}
            for key, rows in rows_of.items():
                starts = {p - k + (0 if from_anchor else 1) - shift for k, p in rows}
                a = starts.pop() if len(starts) == 1 else None
                if a is None or a // seq != row_of[key] or tokens[a] != token_of[key]:
                    break
                found[key] = a
            else:
                self.flow["anchors_from"] = "the targets' positions and the data's tokens"
                return found
        self.note("the anchors could not be told from the data (no offset of the targets' positions puts every "
                  "block's anchor token on the data's token): the targets' alignment is not checked")
        return None

    def alignment(self, live: list, positions: list, anchors: dict) -> None:
        from_anchor = bool(self.drafter_facts.get("sample_from_anchor", False))
        shifts = Counter()
        for (slot, _, _, _), pos in zip(live, positions):
            if slot is None or pos is None or slot[:3] not in anchors:
                continue
            shifts[pos - (anchors[slot[:3]] + slot[3] - (0 if from_anchor else 1))] += 1
        seq, length = self.cands.seq_len, self.block_length
        late = sorted({a % seq for a in anchors.values() if a % seq + length > seq})
        if late:
            self.add(Finding("anchors", "divergence", f"anchors {late} leave no room for a whole block in {seq} "
                             f"tokens (the reference excludes the last {length} positions)", late, None, pitfall=8,
                             key="late_anchors"), edge="block")
        for call, block in self.blocks.items():
            if "mask" in block:
                known = {key[1:]: a % seq for key, a in anchors.items() if key[0] == call}
                self.training_mask(self.tensors[block["mask"]], block, known, call)
        if not shifts:
            return
        shift, count = shifts.most_common(1)[0]
        self.flow["target_shift"] = shift
        if shift != 0 and count >= sum(shifts.values()) / 2:
            self.add(Finding("target_alignment", "divergence",
                             f"the targets are shifted by {shift:+d}: slot k of the block at anchor a is trained "
                             f"toward the target's logits at position a + k{f'{shift - 1:+d}' if shift != 1 else ''}; "
                             "the reference (DFlash, sample_from_anchor false) takes them at a + k - 1", shift, 0,
                             pitfall=5, key="shift", raw={"rows": dict(shifts)}), edge="targets")

    def label_source(self, live: list, positions) -> str | None:
        """Hard labels (one-hot targets): the data's next tokens, or a candidate's argmax, at the row's place."""
        labels = [int(p.argmax()) for _, _, p, _ in live]
        tokens = self.cands.tokens.reshape(-1)
        anchors = {}
        for call, block in self.blocks.items():
            for key, a in block.get("positions", {}).items():
                anchors[(call, *key)] = a
        seq = self.cands.seq_len
        batch = tokens.numel() // seq
        options: dict[str, list[int]] = {}
        tops = {c: logits.argmax(-1) for c, logits in self.cands.logits.items()}
        for shift in (0, 1, -1):
            data, argmax = [], {c: [] for c in self.cands.logits}
            for (slot, _, _, _) in live:
                a = anchors.get(slot[:3]) if slot is not None else None
                if a is None:
                    return None
                pos = a + slot[3] - 1 + shift
                row = min(slot[1], batch - 1) * seq  # the drafter call's batch row: the data's row
                data.append(int(tokens[row + pos + 1]) if pos + 1 in range(seq) else -1)
                for c, top in tops.items():
                    argmax[c].append(int(top[row + pos]) if pos in range(seq) else -1)
            options[f"the data's next tokens{f' (shifted by {shift:+d})' if shift else ''}"] = data
            for c, values in argmax.items():
                options[f"the argmax of {c.name}{f' (shifted by {shift:+d})' if shift else ''}"] = values
        scored = sorted(((sum(a == b for a, b in zip(labels, v)) / len(labels), k) for k, v in options.items()),
                        key=lambda x: -x[0])
        share, best = scored[0]
        self.flow["labels"] = f"{best} ({share:.0%} of {len(labels)} rows)"
        if share < 1.0:  # said plainly, never turned into a guessed source or a guessed noise
            self.add(Finding("unexplained", "warning", f"the hard labels are no candidate's argmax and not the "
                             f"data's tokens: the nearest, {best}, agrees on {share:.0%} of {len(labels)} rows (a "
                             "source or noise the labels cannot tell apart)", None, None, key="labels"),
                     edge="targets")
        if share == 1.0:
            source = next((c for c in self.cands.logits if best == f"the argmax of {c.name}"), None)
            if source is not None and source != self.cands.reference_logits:
                named = Named(source, 0.0, True)
                self.target_findings(named, "the hard labels, the argmax of the targets")
        return best if share == 1.0 else None

    def weights(self, trained: list) -> None:
        """Each slot's weight, relative to its block's first trained slot (the reduction's divisor cancels)."""
        blocks: dict[tuple, dict[int, float]] = {}
        for slot, c, _, _ in trained:
            if slot is not None:
                blocks.setdefault(slot[:3], {})[slot[3]] = c
        ratios: dict[int, list[float]] = {}
        anchor_weight = 0.0
        for per in blocks.values():
            first = min((k for k, c in per.items() if k >= 1 and c > 0), default=None)
            if first is None:
                continue
            for k, c in per.items():
                if k == 0:
                    anchor_weight = max(anchor_weight, c / per[first])
                elif c > 0:
                    ratios.setdefault(k - first + 1, []).append(c / per[first])
        if not ratios:
            return
        means = {k: sum(v) / len(v) for k, v in sorted(ratios.items())}
        spread = max(max(v) - min(v) for v in ratios.values())
        fit = fit_weights(means)
        self.flow["weights"] = fit["text"]
        if spread > 1e-4:
            self.add(Finding("loss_weights", "warning", f"the loss weights vary between blocks at the same slot (by "
                             f"{spread:.3g}): a per-block weighting (D-PACE?) or a mask, not fitted", None, None,
                             pitfall=18, key="per_block"))
        if anchor_weight > 0:
            self.add(Finding("loss_weights", "divergence", f"the anchor slot (slot 0) is trained with weight "
                             f"{anchor_weight:.3g} (relative to slot 1); the reference gives it 0 (it is the input, "
                             "not a prediction)", anchor_weight, 0.0, pitfall=6, key="anchor_slot"), edge="loss")
        self.fitted = fit

    def loss_kind(self, live: list, trained: list, hard: bool, label_source: str | None) -> None:
        """The loss recomputed from its rows (each row's weight and target, read from the gradient): KL or
        cross-entropy, against the recorded value."""
        recorded = float(self.meta["loss"])
        c = torch.tensor([row[1] for row in live], dtype=torch.float64)
        p = torch.stack([row[2] for row in live]).double() if live else torch.zeros(0, 1, dtype=torch.float64)
        lq = torch.stack([row[3] for row in live]).double() if live else torch.zeros(0, 1, dtype=torch.float64)
        kl = float((c * (p * (p.clamp_min(1e-30).log() - lq)).sum(-1)).sum())
        ce = float((c * -(p * lq).sum(-1)).sum())
        close = [kind for kind, value in (("kl_div", kl), ("ce", ce))
                 if abs(value - recorded) <= 1e-4 * max(1.0, abs(recorded))]
        kind = None
        if hard:  # toward a candidate's argmax: speculators' "ce"; toward the data's tokens: no speculators setting
            kind = "ce" if close and label_source and "argmax" in label_source else None
        elif close:
            kind = close[0] if len(close) == 1 else "kl_div"
        if not close:
            best = min(abs(kl - recorded), abs(ce - recorded)) / max(1e-12, abs(recorded))
            self.findings.append(Finding("loss", "warning", f"the recorded loss {recorded:.6g} is not reproduced as "
                                         f"the weighted sum of its rows' KL or cross-entropy (relative difference "
                                         f"{best:.2g})", recorded, None, pitfall=7, key="unrecognized"))
        else:
            self.flow["loss_kind"] = close[0] if not hard else "ce toward hard labels"
            self.reduction(live, trained)
        self.recipe_findings(kind, label_source)

    def reduction(self, live: list, trained: list) -> None:
        """The reference reduces as sum(w * mask * loss) / (sum(mask) + 1e-5) per sequence, then the mean: a slot-1
        row of a sequence weighs 1 / (n_sequences * (rows of the sequence + 1e-5))."""
        fit = getattr(self, "fitted", None)
        if not fit or fit.get("kind") not in ("uniform", "fixed-exp-decay"):
            return
        per_seq: dict[object, list] = {}
        for slot, c, _, _ in live:
            if slot is not None:
                per_seq.setdefault((slot[0], slot[1]), []).append((slot[3], c))
        if not per_seq:
            return
        block_rows = {}
        for call, block in self.blocks.items():
            for s in block["slots"]:
                if s is not None:
                    block_rows[(call, s[0])] = block_rows.get((call, s[0]), 0) + 1
        n = len(per_seq)
        every = Counter((slot[0], slot[1]) for slot, _, _, _ in trained if slot is not None)
        bad = []
        for key, rows in per_seq.items():
            firsts = [c for k, c in rows if k == 1]
            if not firsts:
                continue
            unit = 1 / (sum(firsts) / len(firsts))
            counts = {len(rows), every.get(key, -1), block_rows.get(key, -1)}
            if not any(abs(unit - n * (m + 1e-5)) <= 1e-3 * unit for m in counts):
                bad.append((key, unit, len(rows)))
        if bad and len(bad) == len(per_seq):
            key, unit, rows = bad[0]
            self.add(Finding("loss_weights", "divergence", f"the loss is reduced with a slot-1 row weighing 1/{unit:.4g} "
                             f"({rows} trained rows in its drafter call's row); the reference reduces as "
                             f"{REFERENCE_REDUCTION}", f"1/{unit:.4g}", REFERENCE_REDUCTION, pitfall=6,
                             key="reduction"), edge="loss")

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
    notes: list[str] = []
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
        extra = {role: [tensors[n] for n, e in meta["entries"].items() if e["role"] == role]
                 for role in ("target_attention_mask", "target_position_ids")}
        width = tokens[0].shape[-1]
        if all(t.shape[-1] == width for t in tokens):
            tokens = [t.reshape(-1, t.shape[-1]) for t in tokens]
        else:  # documents of different lengths, each run alone: read as one packed row, in the order they ran
            tokens = [torch.cat([t.reshape(-1) for t in tokens])]
        # Every target call of the step (micro-batches) as one batch of rows: a row's place is its flat index.
        mask = extra["target_attention_mask"][0] if len(extra["target_attention_mask"]) == 1 and \
            len(tokens) == 1 else None
        positions = extra["target_position_ids"][0] if len(extra["target_position_ids"]) == 1 and \
            len(tokens) == 1 else None
        if mask is not None and bool(mask.dim() == 2 and mask.bool().all()):
            mask = None  # no padding: the plain rerun
        documents = [t.reshape(-1) for n, e in meta["entries"].items() if e["role"] == "tokens"
                     for t in [tensors[n]]] if len({tensors[n].shape[-1] for n, e in meta["entries"].items()
                                                     if e["role"] == "tokens"}) > 1 else None
        cands = TargetCandidates(target, documents or torch.cat(tokens), mask, positions)
        reference = reference_for(meta["drafter"]["facts"], cands.layers, ref_data)
        audit = StepAudit(meta, tensors, cands, reference, pad_id, index)
        audit.run()
        for f in audit.findings:
            if (f.component, f.key) not in seen:
                seen.add((f.component, f.key))
                findings.append(f)
        rows.extend(audit.rows.values())
        notes.extend(n for n in audit.notes if n not in notes)
        if index == 0:
            flow = {**audit.flow, "divergent": sorted(audit.flow["divergent"]), "target_layers": cands.layers,
                    "reference_layers": reference.layer_ids, "reference_source": reference.layer_source}
            facts = {"target": target_meta, "drafter": meta["drafter"], "reference": reference.__dict__,
                     "loss": meta["loss"], "steps": len(steps), "context": recording.manifest.get("context", {}),
                     "recording": str(recording.folder)}
    from dflash_audit.trace.run_audit import audit_run

    run = audit_run(recording.manifest)  # the run across steps (trace --steps N)
    findings.extend(run.findings)
    notes.extend(run.notes)
    facts["run"] = run.facts
    return TraceReport(sort_findings(findings), rows, facts, flow, notes)
