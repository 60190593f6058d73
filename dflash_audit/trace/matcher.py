"""What a recorded tensor is, by value: the target recomputed from the recorded token ids gives every tensor a
trainer may have read (each `hidden_states[i]`, the last layer before the final norm, the final norm of each layer's
raw output, the head's logits from each of those), and each recorded tensor is named by the candidate it equals.

The hidden states come from the live check's `TargetReplay` (dflash_audit/rounds/by_value.py), and "equal" is its
`relative` difference within `SAME` (float32 kernel noise; `LOOSE` for a recording in half precision). A tensor
near a candidate but not equal to it is the candidate plus a residual: its size is reported; past `NOISE_LIMIT` of
the candidate's own spread no candidate explains it, and it stays unexplained with the nearest distance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.extract import output_head
from dflash_audit.rounds.by_value import SAME, TargetReplay, relative

LOOSE = 3e-2  # bfloat16/float16 recordings: one rounding of a half-precision kernel
NOISE_LIMIT = 0.5  # a residual this large against the clean tensor's std is no longer "candidate + noise"


def tolerance(dtype: str) -> float:
    return SAME if dtype in ("float32", "float64") else LOOSE


@dataclass(frozen=True)
class Candidate:
    name: str  # what it is, in words
    index: int | None  # its hidden_states index (None: none of them)
    layer: int | None  # the decoder layer (z-lab id) whose output it is, None for the embeddings
    normed: bool  # through the final norm
    kind: str  # hidden | logits


@dataclass
class Named:
    """A recorded tensor named by the nearest candidate."""
    candidate: Candidate | None
    distance: float  # relative max difference to the candidate
    equal: bool
    residual_std: float = 0.0
    clean_std: float = 0.0
    positions: torch.Tensor | None = None  # the candidate's row (flat position) each recorded row equals

    @property
    def relative_noise(self) -> float:
        return self.residual_std / self.clean_std if self.clean_std else float("inf")

    @property
    def noisy(self) -> bool:
        """The candidate plus a residual no candidate explains, small against the candidate."""
        return not self.equal and self.candidate is not None and self.relative_noise < NOISE_LIMIT

    def describe(self) -> str:
        if self.candidate is None:
            return "no candidate"
        if self.equal:
            return f"{self.candidate.name} (relative difference {self.distance:.2g})"
        if self.noisy:
            return (f"{self.candidate.name} plus a residual of std {self.residual_std:.3g} "
                    f"({self.relative_noise:.2g} of its std)")
        return f"unexplained (nearest: {self.candidate.name}, relative difference {self.distance:.3g})"


def centered_log_probs(x: torch.Tensor) -> torch.Tensor:
    """Logits, log-probabilities or probabilities, as log-probabilities centred per row: the same distribution
    gives the same row whichever of the three a trainer kept."""
    x = x.float()
    if x.min() >= 0 and torch.allclose(x.sum(-1), torch.ones_like(x.sum(-1)), atol=1e-3):
        x = x.clamp_min(1e-30).log()
    x = torch.log_softmax(x, -1)
    return x - x.mean(-1, keepdim=True)


class BatchReplay:
    """One row of the target's hidden states on a batch run with the trainer's own attention mask / position ids."""

    _cache: dict = {}

    def __init__(self, target, tokens, attention_mask, position_ids, row: int):
        key = (id(target), id(tokens))
        if key not in BatchReplay._cache:
            captured = {}
            handle = target.model.norm.register_forward_pre_hook(lambda m, args: captured.update(pre=args[0]))
            device = next(target.parameters()).device
            extra = {}
            if attention_mask is not None:
                extra["attention_mask"] = attention_mask.to(device)
            if position_ids is not None:
                extra["position_ids"] = position_ids.to(device)
            try:
                with torch.inference_mode():
                    out = target(tokens.to(device), output_hidden_states=True, **extra)
            finally:
                handle.remove()
            BatchReplay._cache.clear()
            BatchReplay._cache[key] = ([h.float() for h in out.hidden_states], captured["pre"].float())
        hidden, pre = BatchReplay._cache[key]
        self.hidden = [h[row] for h in hidden]
        self.pre_norm = pre[row]
        self.layers = len(self.hidden) - 1


class TargetCandidates:
    """Every candidate the target computes from the recorded token ids ([batch, seq]), rows flattened."""

    def __init__(self, target, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None):
        if isinstance(tokens, list):  # documents run one by one (packed by the trainer): one row, end to end
            states = [TargetReplay(target, row.tolist()) for row in tokens]
            tokens = torch.cat(tokens)[None]
        elif attention_mask is None and position_ids is None:
            states = [TargetReplay(target, row.tolist()) for row in tokens]
        else:  # padding or packed documents: the target rerun on the batch as the trainer ran it
            states = [BatchReplay(target, tokens, attention_mask, position_ids, b) for b in range(tokens.shape[0])]
        self.layers = states[0].layers
        self.seq_len = tokens.shape[1]
        self.tokens = tokens
        n = self.layers
        decoder = target.get_decoder()
        head = output_head(target)
        self.hidden: dict[Candidate, torch.Tensor] = {}

        def stack(pick):
            return torch.cat([pick(s) for s in states]).cpu()

        self.hidden[Candidate("hidden_states[0] (the embeddings)", 0, None, False, "hidden")] = stack(
            lambda s: s.hidden[0])
        for i in range(1, n):
            self.hidden[Candidate(f"hidden_states[{i}] (the raw output of layer {i - 1})", i, i - 1, False,
                                  "hidden")] = stack(lambda s, i=i: s.hidden[i])
        self.hidden[Candidate(f"hidden_states[{n}] (layer {n - 1} after the final norm)", n, n - 1, True,
                              "hidden")] = stack(lambda s: s.hidden[n])
        self.hidden[Candidate(f"the raw output of layer {n - 1} (before the final norm)", None, n - 1, False,
                              "hidden")] = stack(lambda s: s.pre_norm)
        device = next(target.parameters()).device
        dtype = next(target.parameters()).dtype
        self.raw = {layer: t for layer, t in
                    [(i - 1, stack(lambda s, i=i: s.hidden[i])) for i in range(1, n)] + [(n - 1, stack(
                        lambda s: s.pre_norm))]}
        self.logits: dict[Candidate, torch.Tensor] = {}
        with torch.inference_mode():
            def through(x, norm):
                x = x.to(device, dtype)
                return head(decoder.norm(x) if norm else x).float().cpu()

            for layer, raw in self.raw.items():
                own = " = the target's own logits" if layer == n - 1 else ""
                self.logits[Candidate(f"head(final_norm(raw output of layer {layer})){own}",
                                      n if layer == n - 1 else None, layer, True, "logits")] = through(raw, True)
                self.logits[Candidate(f"head(raw output of layer {layer}) (no final norm)", None, layer, False,
                                      "logits")] = through(raw, False)
            self.logits[Candidate(f"head(final_norm(hidden_states[{n}])) (the final norm applied twice)", None,
                                  n - 1, True, "logits")] = through(self.hidden_final, True)
            self.embedding = target.get_input_embeddings()
        reference = self.reference_logits  # first: a tie (a final norm of weight 1 applied twice) names it
        self.logits = {reference: self.logits[reference], **self.logits}
        self._log_probs = {c: centered_log_probs(t) for c, t in self.logits.items()}

    @property
    def hidden_final(self) -> torch.Tensor:
        return next(t for c, t in self.hidden.items() if c.index == self.layers)

    @property
    def reference_logits(self) -> Candidate:
        return next(c for c in self.logits if c.index == self.layers)

    def log_probs(self) -> dict[Candidate, torch.Tensor]:
        return self._log_probs

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.embedding.weight
        with torch.inference_mode():
            return self.embedding(ids.to(weight.device)).float().cpu()


def name_rows(rows: torch.Tensor, bank: dict[Candidate, torch.Tensor], tol: float,
              positions: torch.Tensor | None = None) -> Named:
    """`rows` [r, d] named by the bank's candidate whose rows (at `positions`, or each row's nearest) are closest."""
    rows = rows.float()
    best = None
    for candidate, table in bank.items():
        if table.shape[-1] != rows.shape[-1]:
            continue
        pos = positions if positions is not None else torch.cdist(rows, table).argmin(1)
        picked = table[pos]
        err = float((rows - picked).pow(2).mean())
        if best is None or err < best[0] * (1 - 1e-4):  # a tie keeps the earlier (plainer) candidate
            best = (err, candidate, pos, picked)
    if best is None:
        return Named(None, float("inf"), False)
    _, candidate, pos, picked = best
    distance = relative(rows, picked)
    residual = rows - picked
    return Named(candidate, distance, distance <= tol, float(residual.std()), float(picked.std()), pos)
