"""fc's inputs: the context features the drafter consumed, named chunk by chunk as the target's layers (plus a
residual: augmentation noise on the drafter's inputs, which the reference allows), and the layers held to the
reference's layer ids.

A row packed from documents (a trainer on offline states, speculators' loader: documents end to end, then zeros) holds
rows no target computed: its padding. Only the documents' rows are named (the recorder cut each document from the
drafter's row where its position ids restart at 0, and kept where it starts); the padding is left out and said, so
that zeros beside the states are not read as a residual on them. So are the rows the recorded masks exclude (the
drafter's attention or key-padding mask, the target's attention mask: row_masks.py): right padding, or the context
past a block's anchor, which nothing the step computes reads."""

from __future__ import annotations

from collections import Counter

from catalogue.findings import Finding
from dflash_audit.target_values import Named, name_hidden
import torch

from dflash_audit.trace.step_audit.state import StepState, as_rows, micro_batch


class ContextAudit(StepState):
    def context_features(self) -> None:
        hidden = self.hidden_size
        for name in self.of_role("drafter_input"):
            if name in self.rows:
                continue
            t = self.tensors[name]
            if t.shape[-1] % hidden:
                continue
            rows, padding = self.context_rows(name)
            chunks = [name_hidden(rows[:, k * hidden:(k + 1) * hidden], self.cands, self.tol(name))
                      for k in range(t.shape[-1] // hidden)]
            if not all(c.equal or c.noisy for c in chunks):
                worst = max(chunks, key=lambda c: c.distance)
                self.account(name, worst.describe() + padding, worst.distance)
                continue
            module = self.entries[name].get("module", "?")
            layers = [c.candidate.layer for c in chunks]
            what = ", ".join(c.candidate.name for c in chunks)
            self.account(name, f"the context features fc reads ({module}): {what}{padding}",
                         max(c.distance for c in chunks))
            self.flow["fc_layers"] = layers
            self.flow["fc_module"] = module
            self.data_rows_of(name, getattr(chunks[0], "positions", None))
            self.fc_finding(layers, chunks)
            noisy = [c for c in chunks if c.noisy]
            if noisy:
                c = max(noisy, key=lambda c: c.relative_noise)
                self.add(Finding("noise", "info", f"the drafter's context features carry noise: {c.describe()} "
                                 "— augmentation of the drafter's inputs, which the reference allows (targets stay "
                                 "clean)", round(c.residual_std, 4), "noise on inputs only", pitfall=15,
                                 key="inputs", raw={"relative": c.relative_noise}))

    def context_rows(self, name: str) -> tuple[torch.Tensor, str]:
        """The fed tensor's rows that hold the target's states, and what was left out, in words: in a packed row, the
        rows of its documents (each recorded token tensor's `packed_start` and length in a row of `packed_length`);
        then the rows the recorded masks exclude are left out (the drafter's attention or key-padding mask, the
        target's attention mask: `masked_rows`). The indices of the rows kept: `context_kept[name]`."""
        t = self.tensors[name]
        rows = as_rows(t)
        keep, said, used = self.masked_rows(name, context=True)
        for n in used:
            if n not in self.rows and all(block.get("mask") != n for block in self.blocks.values()):
                self.account(n, f"the drafter's {self.entries[n].get('kwarg')} (drafter call "
                                f"{self.entries[n].get('call')}): the context rows it hides are left out of the "
                                "comparisons")
        words = [f"{part} left out ({self.excluded_values(rows, hidden)})" for part, hidden in said]
        documents = self.packed_documents(name, rows.shape[0])
        if documents is not None and not bool(documents.all()):
            outside = ~documents & keep
            keep &= documents
            if bool(outside.any()):
                words.insert(0, f"the packed row's {int(outside.sum())} rows of padding past its "
                                f"{self.documents_in(name)} documents left out ({self.excluded_values(rows, outside)})")
        self.context_kept[name] = keep.nonzero().flatten()
        if bool(keep.all()) or not bool(keep.any()):
            self.context_kept[name] = torch.arange(rows.shape[0])
            return rows, ""
        return rows[keep], "".join(f"; {w}" for w in words)

    def data_rows_of(self, name: str, positions: torch.Tensor | None) -> None:
        """Each batch element of the drafter's call: the data row its context features were named in (the row most
        of its compared rows equal), for layouts where an element is not a data row (each (row, anchor) pair its own
        element): `element_rows`."""
        t = self.tensors[name]
        block = self.blocks.get(self.entries[name].get("call"))
        if positions is None or t.dim() < 3 or name not in self.context_kept or block is None or \
                block["ids"].shape[0] != t.shape[:-2].numel():
            return  # no call whose blocks lie one batch element each beside the features'
        call, width = self.entries[name].get("call"), t.shape[-2]
        seq = self.cands.seq_len
        found: dict[int, Counter] = {}
        for index, place in zip(self.context_kept[name].tolist(), positions.tolist()):
            found.setdefault(index // width, Counter())[int(place) // seq] += 1
        for element, rows in found.items():
            row, count = rows.most_common(1)[0]
            if count == sum(rows.values()):  # every compared row of the element in one data row
                self.element_rows[(call, element)] = row

    @staticmethod
    def excluded_values(rows: torch.Tensor, left_out: torch.Tensor) -> str:
        top = float(rows[left_out].abs().max())
        return "all zero" if top == 0 else f"max |x| {top:.3g}"

    def documents_in(self, name: str) -> int:
        return sum(1 for n in self.of_role("tokens") if micro_batch(n) == micro_batch(name))

    def packed_documents(self, name: str, count: int) -> torch.Tensor | None:
        """In a row packed from documents, which of its `count` rows are a document's; None: not such a row."""
        documents = [n for n in self.of_role("tokens") if micro_batch(n) == micro_batch(name)]
        spans = [(self.entries[n].get("packed_start"), self.tensors[n].numel(), self.entries[n].get("packed_length"))
                 for n in documents]
        if not spans or any(start is None for start, _, _ in spans) or {length for _, _, length in spans} != {count}:
            return None
        documents_rows = torch.zeros(count, dtype=torch.bool)
        for start, size, _ in spans:
            documents_rows[start:start + size] = True
        return documents_rows

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
            extra = [x for x in layers if x not in ref]
            fed = f"fc is fed {len(layers)} of {len(ref)}" if len(layers) < len(ref) else \
                f"fc is fed {len(layers)} layers where the reference feeds {len(ref)}"
            self.add(Finding("fc_dims", "divergence",
                             f"fc reads hidden_states of target layers {read} ({len(layers)} layers); {self.ref.layer_source} "
                             f"reads {want}{said}: {fed}"
                             + (f", without layer {', '.join(map(str, missing))}" if missing else "")
                             + (f", with layer {', '.join(map(str, extra))} beyond them" if extra and
                                len(layers) > len(ref) else ""),
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
