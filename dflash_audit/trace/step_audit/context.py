"""fc's inputs: the context features the drafter consumed, named chunk by chunk as the target's layers (plus a
residual: augmentation noise on the drafter's inputs, which the reference allows), and the layers held to the
reference's layer ids.

A row packed from documents (a trainer on offline states, speculators' loader: documents end to end, then zeros) holds
rows no target computed: its padding. Only the documents' rows are named (the recorder cut each document from the
drafter's row where its position ids restart at 0, and kept where it starts); the padding is left out and said, so
that zeros beside the states are not read as a residual on them. So are the rows the recorded masks exclude (the
drafter's attention or key-padding mask, the target's attention mask: row_masks.py): right padding, or the context
past a block's anchor, which nothing the step computes reads.

The stage: `name_context(step, blocks) -> Context`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from catalogue.findings import Finding
from dflash_audit.target_values import Named, name_hidden
import torch

from dflash_audit.trace.step_audit.blocks import Blocks
from dflash_audit.trace.step_audit.row_masks import context_seen, is_mask_keyword
from dflash_audit.trace.step_audit.state import StepState, as_rows, micro_batch


@dataclass
class Context:
    """What the context features tell the stages after: each fed tensor's rows compared (`kept`: their indices),
    each batch element's data row where it is not one (`element_rows`: (call, element) -> row), and the context
    positions the drafter's mask lets each batch element see (`masks`: (call, element) -> positions)."""
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    element_rows: dict[tuple[int, int], int] = field(default_factory=dict)
    masks: dict[tuple[int, int], list[int]] = field(default_factory=dict)


def name_context(step: StepState, blocks: Blocks) -> Context:
    """Each fed tensor not yet named (the block tokens' embedding is), as wide as whole hidden states: named chunk by
    chunk as target layers, then held to the reference's layer ids."""
    found = Context()
    hidden = step.hidden_size
    for name in step.of_role("drafter_input"):
        if name in step.rows:
            continue
        t = step.tensors[name]
        if t.shape[-1] % hidden:
            continue
        rows, padding = context_rows(step, blocks, found, name)
        chunks = [name_hidden(rows[:, k * hidden:(k + 1) * hidden], step.cands, step.tol(name))
                  for k in range(t.shape[-1] // hidden)]
        if not all(c.equal or c.noisy for c in chunks):
            worst = max(chunks, key=lambda c: c.distance)
            step.account(name, worst.describe() + padding, worst.distance)
            continue
        module = step.entries[name].get("module", "?")
        layers = [c.candidate.layer for c in chunks]
        what = ", ".join(c.candidate.name for c in chunks)
        step.account(name, f"the context features fc reads ({module}): {what}{padding}",
                     max(c.distance for c in chunks))
        step.flow["fc_layers"] = layers
        step.flow["fc_module"] = module
        data_rows_of(step, blocks, found, name, getattr(chunks[0], "positions", None))
        fc_finding(step, layers, chunks)
        noisy = [c for c in chunks if c.noisy]
        if noisy:
            c = max(noisy, key=lambda c: c.relative_noise)
            step.add(Finding("noise", "info", f"the drafter's context features carry noise: {c.describe()} "
                             "— augmentation of the drafter's inputs, which the reference allows (targets stay "
                             "clean)", round(c.residual_std, 4), "noise on inputs only", pitfall=15,
                             key="inputs", raw={"relative": c.relative_noise}))
    return found


def context_rows(step: StepState, blocks: Blocks, found: Context, name: str) -> tuple[torch.Tensor, str]:
    """The fed tensor's rows that hold the target's states, and what was left out, in words: in a packed row, the
    rows of its documents (each recorded token tensor's `packed_start` and length in a row of `packed_length`);
    then the rows the recorded masks exclude are left out (the drafter's attention or key-padding mask, the
    target's attention mask: `drafter_masked_rows`). The indices of the rows kept: `found.kept[name]`."""
    t = step.tensors[name]
    rows = as_rows(t)
    keep, said, used = drafter_masked_rows(step, blocks, found, name)
    for n in used:
        if n not in step.rows and all(block.get("mask") != n for block in blocks.calls.values()):
            step.account(n, f"the drafter's {step.entries[n].get('kwarg')} (drafter call "
                            f"{step.entries[n].get('call')}): the context rows it hides are left out of the "
                            "comparisons")
    words = [f"{part} left out ({excluded_values(rows, hidden)})" for part, hidden in said]
    documents = packed_documents(step, name, rows.shape[0])
    if documents is not None and not bool(documents.all()):
        outside = ~documents & keep
        keep &= documents
        if bool(outside.any()):
            words.insert(0, f"the packed row's {int(outside.sum())} rows of padding past its "
                            f"{documents_in(step, name)} documents left out ({excluded_values(rows, outside)})")
    found.kept[name] = keep.nonzero().flatten()
    if bool(keep.all()) or not bool(keep.any()):
        found.kept[name] = torch.arange(rows.shape[0])
        return rows, ""
    return rows[keep], "".join(f"; {w}" for w in words)


def drafter_masked_rows(step: StepState, blocks: Blocks, found: Context, name: str) -> \
        tuple[torch.Tensor, list[tuple[str, torch.Tensor]], list[str]]:
    """Which of the drafter's context features' rows (laid out as `as_rows`) the step's recorded masks leave as
    evidence, what each mask left out (in words, with the rows), and the drafter masks read (row_masks.py): the
    target's attention mask (`StepState.masked_rows`), then its own call's masks; each batch element's context seen
    is kept (`found.masks`)."""
    t = step.tensors[name]
    keep, said = step.masked_rows(name)
    used = []
    call = step.entries[name].get("call")
    if t.dim() < 2 or call is None:
        return keep, said, used
    elements, width = t.shape[:-2].numel(), t.shape[-2]
    queries = blocks.calls[call]["ids"].shape[-1] if call in blocks.calls else 0
    for n in step.of_role("drafter_kwarg"):
        kwarg = str(step.entries[n].get("kwarg", ""))
        if step.entries[n].get("call") != call or not is_mask_keyword(kwarg):
            continue
        seen = context_seen(step.tensors[n], kwarg, elements, width, queries)
        if seen is None:
            continue
        used.append(n)
        for e, row in enumerate(seen.tolist()):
            found.masks[(call, e)] = [i for i, x in enumerate(row) if x]
        hidden = ~seen.reshape(-1) & keep
        if bool(hidden.any()):
            said.append((f"{int(hidden.sum())} rows the drafter's {kwarg} hides", hidden))
            keep &= ~hidden
    return keep, said, used


def data_rows_of(step: StepState, blocks: Blocks, found: Context, name: str, positions: torch.Tensor | None) -> None:
    """Each batch element of the drafter's call: the data row its context features were named in (the row most
    of its compared rows equal), for layouts where an element is not a data row (each (row, anchor) pair its own
    element): `found.element_rows`."""
    t = step.tensors[name]
    block = blocks.calls.get(step.entries[name].get("call"))
    if positions is None or t.dim() < 3 or name not in found.kept or block is None or \
            block["ids"].shape[0] != t.shape[:-2].numel():
        return  # no call whose blocks lie one batch element each beside the features'
    call, width = step.entries[name].get("call"), t.shape[-2]
    seq = step.cands.seq_len
    by_element: dict[int, Counter] = {}
    for index, place in zip(found.kept[name].tolist(), positions.tolist()):
        by_element.setdefault(index // width, Counter())[int(place) // seq] += 1
    for element, rows in by_element.items():
        row, count = rows.most_common(1)[0]
        if count == sum(rows.values()):  # every compared row of the element in one data row
            found.element_rows[(call, element)] = row


def excluded_values(rows: torch.Tensor, left_out: torch.Tensor) -> str:
    top = float(rows[left_out].abs().max())
    return "all zero" if top == 0 else f"max |x| {top:.3g}"


def documents_in(step: StepState, name: str) -> int:
    return sum(1 for n in step.of_role("tokens") if micro_batch(n) == micro_batch(name))


def packed_documents(step: StepState, name: str, count: int) -> torch.Tensor | None:
    """In a row packed from documents, which of its `count` rows are a document's; None: not such a row."""
    documents = [n for n in step.of_role("tokens") if micro_batch(n) == micro_batch(name)]
    spans = [(step.entries[n].get("packed_start"), step.tensors[n].numel(), step.entries[n].get("packed_length"))
             for n in documents]
    if not spans or any(start is None for start, _, _ in spans) or {length for _, _, length in spans} != {count}:
        return None
    documents_rows = torch.zeros(count, dtype=torch.bool)
    for start, size, _ in spans:
        documents_rows[start:start + size] = True
    return documents_rows


def fc_finding(step: StepState, layers: list[int | None], chunks: list[Named]) -> None:
    ref = step.ref.layer_ids
    declared = step.drafter_facts.get("target_layer_ids")
    said = f" (the drafter's config declares {declared})" if declared is not None and declared != layers else ""
    read = ", ".join(str(x) for x in layers)
    want = ", ".join(str(x) for x in ref)
    if not ref:
        step.note(f"fc reads target layers {read}; the reference's layer ids are {step.ref.layer_source}: not "
                  "checked (give --ref a config declaring target_layer_ids)")
        return
    if layers == ref:
        return
    if len(layers) != len(ref):
        missing = [x for x in ref if x not in layers]
        extra = [x for x in layers if x not in ref]
        fed = f"fc is fed {len(layers)} of {len(ref)}" if len(layers) < len(ref) else \
            f"fc is fed {len(layers)} layers where the reference feeds {len(ref)}"
        step.add(Finding("fc_dims", "divergence",
                         f"fc reads hidden_states of target layers {read} ({len(layers)} layers); {step.ref.layer_source} "
                         f"reads {want}{said}: {fed}"
                         + (f", without layer {', '.join(map(str, missing))}" if missing else "")
                         + (f", with layer {', '.join(map(str, extra))} beyond them" if extra and
                            len(layers) > len(ref) else ""),
                         layers, ref, pitfall=4, key="fc_layers"), edge="fc")
    elif all(a is not None and a - b == layers[0] - ref[0] for a, b in zip(layers, ref)) and \
            abs(layers[0] - ref[0]) == 1:
        step.add(Finding("target_layers", "divergence", f"fc reads hidden_states of target layers {read}, each "
                         f"one {'above' if layers[0] > ref[0] else 'below'} {want} ({step.ref.layer_source}): "
                         "the layer id read as hs[id] instead of hs[id + 1] or the reverse", layers, ref,
                         pitfall=2, key="fc_layers"), edge="fc")
    else:
        step.add(Finding("target_layers", "divergence", f"fc reads hidden_states of target layers {read}; "
                         f"{step.ref.layer_source} reads {want}{said}", layers, ref, pitfall=1,
                         key="fc_layers"), edge="fc")
