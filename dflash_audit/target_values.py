"""The by-value core: what the target computes on recorded token ids, and a recorded tensor named by the candidate it
equals, in memory bounded by the user's own step.

One replay of the target (`TargetRun`) keeps each layer's output as it is computed (forward hooks, no logits, no KV
cache) in a `StateStore`: in memory while small, else each layer in a temporary file of its own, read back one at a
time, so that holding them costs the same with 64 layers as with 12. Every candidate a trainer may have read is
produced from it on demand (`TargetCandidates`): each `hidden_states[i]`, the last layer before the final norm, and
the head's logits from each layer's raw output, with and without the final norm (plus the final norm applied
twice). Logits are never made for every position: only at the rows asked for, in chunks.

Naming (`name_hidden`, `name_logits`) holds one candidate at a time. The name is decided on a spread sample of the
recorded rows (`SAMPLE_ROWS`), each row matched to its nearest position of the candidate; for logits the nearest
position is found without the vocabulary, in the hidden space: centred log-probabilities are linear in the head's
input, z - mean(z) = W_c h, so |y - W_c h|^2 = |y|^2 - 2 (y W) . h + h^T (W_c^T W_c) h. The winner (the plainer of
near-ties, computed exactly through the real head) is then confirmed on every row, in chunks, and its numbers (the
relative difference, the residual's std) are those of every row.

"Equal" is a relative difference within `SAME` (float32 kernel noise), `LOOSE` for a recording in half precision;
past `NOISE_LIMIT` of the candidate's own spread a residual is no longer "the candidate plus noise".
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from impl.extract import output_head
from impl.layers import final_layer, hidden_state_index

SAME = 1e-3  # max |a - b| / max |b|: two float32 kernels computing the same tensor stay far below it
LOOSE = 3e-2  # bfloat16/float16 recordings: one rounding of a half-precision kernel
NOISE_LIMIT = 0.5  # a residual this large against the clean tensor's std is no longer "candidate + noise"
SAMPLE_ROWS = 256  # rows a name is decided on; the winner is then confirmed on every row
CHUNK_ROWS = 256  # rows per vocabulary-wide computation
SPILL_BYTES = 256 << 20  # past this, the target's states are kept on disk, a layer a file
TIE = 1e-4  # two candidates whose errors are this close (relative) tie: the earlier (plainer) one is kept


def tolerance(dtype: str) -> float:
    return SAME if dtype in ("float32", "float64") else LOOSE


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float32 whatever the tensors' dtypes."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def relative_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest row-wise relative difference (each row against its own scale)."""
    scale = b.abs().amax(-1).clamp_min(1e-12)
    return float(((a - b).abs().amax(-1) / scale).max())


def spread_sample(rows: int, size: int | None = None) -> torch.Tensor:
    """`size` (`SAMPLE_ROWS`) row indices spread evenly over `rows` (all of them when fewer): over the batch and the
    positions alike, the same on every run."""
    size = SAMPLE_ROWS if size is None else size
    if rows <= size:
        return torch.arange(rows)
    return torch.linspace(0, rows - 1, size).round().long().unique()


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
    sampled: int = 0  # rows the name was decided on
    rows: int = 0  # rows it was confirmed on

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

    @property
    def sampling(self) -> str | None:
        """What was sampled, in words; None where every row decided the name."""
        if self.sampled >= self.rows:
            return None
        return f"named on {self.sampled} of {self.rows} rows, confirmed on all {self.rows}"


def centered_log_probs(x: torch.Tensor) -> torch.Tensor:
    """Logits, log-probabilities or probabilities, as log-probabilities centred per row: the same distribution
    gives the same row whichever of the three a trainer kept."""
    x = x.float()
    if x.min() >= 0 and torch.allclose(x.sum(-1), torch.ones_like(x.sum(-1)), atol=1e-3):
        x = x.clamp_min(1e-30).log()
    x = torch.log_softmax(x, -1)
    return x - x.mean(-1, keepdim=True)


class StateStore:
    """Tensors of [rows, width] appended part by part under a key, kept in their own dtype on the CPU: in memory
    while the whole is small, else a file a key in a temporary folder (removed with the store)."""

    def __init__(self, expected_bytes: int):
        self._folder = tempfile.TemporaryDirectory(prefix="dflash-audit-states-") \
            if expected_bytes > SPILL_BYTES else None
        self._parts: dict[object, list[torch.Tensor]] = {}
        self._meta: dict[object, tuple[torch.dtype, int, int]] = {}  # dtype, rows, width

    def _file(self, key) -> Path:
        return Path(self._folder.name) / f"{key}.bin"

    def put(self, key, rows: torch.Tensor) -> None:
        rows = rows.detach().reshape(-1, rows.shape[-1])
        dtype, count, width = self._meta.get(key, (rows.dtype, 0, rows.shape[-1]))
        self._meta[key] = (dtype, count + rows.shape[0], width)
        if self._folder is None:
            self._parts.setdefault(key, []).append(rows.to("cpu", copy=True))
            return
        with open(self._file(key), "ab") as handle:
            handle.write(rows.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())

    def get(self, key) -> torch.Tensor:
        dtype, count, width = self._meta[key]
        if self._folder is None:
            parts = self._parts[key]
            if len(parts) > 1:
                self._parts[key] = parts = [torch.cat(parts)]
            return parts[0]
        raw = torch.from_numpy(np.fromfile(self._file(key), dtype=np.uint8))
        return raw.view(dtype).reshape(count, width)

    def __contains__(self, key) -> bool:
        return key in self._meta

    def close(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()
        self._parts.clear()


class TargetRun:
    """One replay of the target on token ids, its states kept in a `StateStore` by hidden_states index (and "pre":
    the last layer's output before the final norm). `runs` is a list of (input_ids [b, t], extra forward kwargs),
    replayed in order, their rows appended: the batch as the trainer ran it, or rows / documents one by one."""

    def __init__(self, target, runs: list[tuple[torch.Tensor, dict]]):
        decoder = target.get_decoder()
        config = target.config
        self.layers = len(decoder.layers)
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        positions = sum(ids.numel() for ids, _ in runs)
        element = torch.finfo(self.dtype).bits // 8
        self.store = StateStore(positions * config.hidden_size * (self.layers + 2) * element)
        n = self.layers

        def keep(key):
            def hook(module, args, output):
                self.store.put(key, output[0] if isinstance(output, tuple) else output)
            return hook

        def keep_input(key):
            def hook(module, args, kwargs):
                self.store.put(key, args[0] if args else kwargs["hidden_states"])
            return hook

        handles = [decoder.layers[0].register_forward_pre_hook(keep_input(0), with_kwargs=True),
                   decoder.norm.register_forward_pre_hook(lambda m, args: self.store.put("pre", args[0])),
                   decoder.norm.register_forward_hook(keep(n))]
        handles += [layer.register_forward_hook(keep(i + 1)) for i, layer in enumerate(decoder.layers[:-1])]
        try:
            with torch.inference_mode():
                for ids, extra in runs:
                    extra = {k: v.to(self.device) for k, v in extra.items()}
                    decoder(input_ids=ids.to(self.device), use_cache=False, **extra)
        finally:
            for handle in handles:
                handle.remove()
        self.positions = positions

    def state(self, key) -> torch.Tensor:
        """A state [positions, hidden] in float32 on the target's device."""
        return self.store.get(key).to(self.device).float()

    def close(self) -> None:
        self.store.close()


class LazyStates(Sequence):
    """hidden_states as a list, each read from the store when indexed (one layer in memory at a time)."""

    def __init__(self, run: TargetRun, cpu: bool = False):
        self.run, self.cpu = run, cpu

    def __len__(self) -> int:
        return self.run.layers + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if i not in range(len(self)):
            raise IndexError(i)
        state = self.run.state(i)
        return state.cpu() if self.cpu else state


class TargetReplay:
    """The target's hidden states (transformers) on one token sequence, and the last layer before its final norm:
    `hidden[i]` is hidden_states[i] [t, H] float32, read from the run's store when indexed."""

    def __init__(self, target, token_ids: list[int]):
        self.run = TargetRun(target, [(torch.tensor([token_ids]), {})])
        self.layers = self.run.layers
        self.hidden = LazyStates(self.run)
        self.device = self.run.device

    @property
    def pre_norm(self) -> torch.Tensor:
        return self.run.state("pre")

    def candidates(self, layer_id: int) -> dict[str, torch.Tensor]:
        """What a capture of z-lab layer `layer_id` may be instead of hidden_states[id + 1]."""
        found = {}
        for shift in (-1, +1):  # a neighbour's output (the one below may be the embeddings, index 0)
            other = layer_id + shift
            if shift < 0 or other < self.layers:
                found[f"the output of layer {other} (shifted by {shift:+d})"] = self.hidden[hidden_state_index(other)]
        if layer_id == final_layer(self.layers):
            found[f"the output of layer {layer_id} before the final norm (training reads it after)"] = self.pre_norm
        return found


@dataclass(frozen=True)
class Source:
    """Where a candidate's tensor comes from: a stored state, through the final norm or not."""
    key: object
    normed: bool


class TargetCandidates:
    """Every candidate the target computes from the recorded token ids ([batch, seq], or documents run one by one),
    rows flattened; produced one at a time from one replay."""

    def __init__(self, target, tokens, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None):
        if isinstance(tokens, list):  # documents run one by one (packed by the trainer): one row, end to end
            runs = [(row.reshape(1, -1), {}) for row in tokens]
            tokens = torch.cat([row.reshape(-1) for row in tokens])[None]
        elif attention_mask is None and position_ids is None:
            runs = [(row[None], {}) for row in tokens]
        else:  # padding or packed documents: the target rerun on the batch as the trainer ran it
            extra = {}
            if attention_mask is not None:
                extra["attention_mask"] = attention_mask
            if position_ids is not None:
                extra["position_ids"] = position_ids
            runs = [(tokens, extra)]
        self.run = TargetRun(target, runs)
        self.layers = n = self.run.layers
        self.seq_len = tokens.shape[1]
        self.tokens = tokens
        self.positions = self.run.positions
        self.hidden_size = target.config.hidden_size
        self.norm = target.get_decoder().norm
        self.head = output_head(target)
        self.vocab = self.head.weight.shape[0]
        self.device, self.dtype = self.run.device, self.run.dtype
        self.embedding = target.get_input_embeddings()
        hidden = [Candidate("hidden_states[0] (the embeddings)", 0, None, False, "hidden")]
        hidden += [Candidate(f"hidden_states[{i}] (the raw output of layer {i - 1})", i, i - 1, False, "hidden")
                   for i in range(1, n)]
        hidden += [Candidate(f"hidden_states[{n}] (layer {n - 1} after the final norm)", n, n - 1, True, "hidden"),
                   Candidate(f"the raw output of layer {n - 1} (before the final norm)", None, n - 1, False, "hidden")]
        self.hidden_sources = {c: Source(c.index if c.index is not None else "pre", False) for c in hidden}
        reference = Candidate(f"head(final_norm(raw output of layer {n - 1})) = the target's own logits", n, n - 1,
                              True, "logits")
        logits = {reference: Source("pre", True)}  # first: a tie (a final norm of weight 1 applied twice) names it
        for layer in range(n):
            raw = hidden_state_index(layer) if layer < final_layer(n) else "pre"  # the last's raw: before the norm
            if layer < n - 1:
                logits[Candidate(f"head(final_norm(raw output of layer {layer}))", None, layer, True, "logits")] = \
                    Source(raw, True)
            logits[Candidate(f"head(raw output of layer {layer}) (no final norm)", None, layer, False, "logits")] = \
                Source(raw, False)
        logits[Candidate(f"head(final_norm(hidden_states[{n}])) (the final norm applied twice)", None, n - 1, True,
                         "logits")] = Source(n, True)
        self.logit_sources = logits
        self._gram: torch.Tensor | None = None

    @property
    def reference_logits(self) -> Candidate:
        return next(iter(self.logit_sources))

    def hidden_candidates(self) -> list[Candidate]:
        return list(self.hidden_sources)

    def logit_candidates(self) -> list[Candidate]:
        return list(self.logit_sources)

    def hidden(self, candidate: Candidate) -> torch.Tensor:
        """The candidate's states at every position [positions, hidden], float32, on the target's device."""
        return self.run.state(self.hidden_sources[candidate].key)

    def head_input(self, candidate: Candidate, positions: torch.Tensor | None = None) -> torch.Tensor:
        """What the head reads for a logits candidate (at `positions`, or every position), float32: the stored state,
        through the final norm in the target's dtype where the candidate is normed."""
        source = self.logit_sources[candidate]
        states = self.run.state(source.key)
        if positions is not None:
            states = states[positions.to(states.device)]
        if not source.normed:
            return states
        with torch.inference_mode():
            return self.norm(states.to(self.dtype)).float()

    def logits(self, candidate: Candidate, positions: torch.Tensor) -> torch.Tensor:
        """The candidate's logits at `positions` [len, vocab], float32 (the head in the target's dtype, as it ran)."""
        with torch.inference_mode():
            x = self.head_input(candidate, positions).to(self.dtype)
            return self.head(x).float()

    def logit_chunks(self, candidate: Candidate, positions: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        for start in range(0, len(positions), CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            yield part, self.logits(candidate, positions[part])

    def argmax(self, candidate: Candidate, positions: torch.Tensor) -> torch.Tensor:
        """The candidate's argmax token at `positions` (chunked: never [positions, vocab] at once)."""
        out = torch.empty(len(positions), dtype=torch.long)
        for part, logits in self.logit_chunks(candidate, positions):
            out[part] = logits.argmax(-1).cpu()
        return out

    def gram(self) -> torch.Tensor | None:
        """W_c^T W_c of the head's centred weight [hidden, hidden], float32 (None: the head is no plain linear)."""
        if not isinstance(self.head, nn.Linear):
            return None
        if self._gram is None:
            gram = torch.zeros(self.hidden_size, self.hidden_size, device=self.device)
            total = torch.zeros(self.hidden_size, device=self.device)
            weight = self.head.weight.detach()
            for start in range(0, self.vocab, 8192):
                w = weight[start:start + 8192].float()
                gram += w.T @ w
                total += w.sum(0)
            mean = total / self.vocab
            self._gram = gram - self.vocab * torch.outer(mean, mean)
        return self._gram

    def centred_bias(self) -> torch.Tensor | None:
        bias = getattr(self.head, "bias", None)
        if bias is None:
            return None
        bias = bias.detach().float()
        return bias - bias.mean()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.embedding.weight
        with torch.inference_mode():
            return self.embedding(ids.to(weight.device)).float().cpu()

    def close(self) -> None:
        self.run.close()


def _nearest(rows: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's nearest table row (index, squared distance), in chunks of rows."""
    index, dist = [], []
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        d = torch.cdist(rows[start:start + CHUNK_ROWS], table)
        best = d.min(1)
        index.append(best.indices)
        dist.append(best.values.pow(2))
    return torch.cat(index), torch.cat(dist)


class _Moments:
    """Running sums for a residual's and a clean tensor's std, and the relative max difference, over row chunks."""

    def __init__(self):
        self.n = 0
        self.r_sum = self.r_sq = self.c_sum = self.c_sq = 0.0
        self.diff_max = self.clean_max = 0.0
        self.err = 0.0

    def add(self, rows: torch.Tensor, picked: torch.Tensor) -> None:
        residual = (rows - picked).double()
        clean = picked.double()
        self.n += rows.numel()
        self.r_sum += float(residual.sum())
        self.r_sq += float(residual.pow(2).sum())
        self.c_sum += float(clean.sum())
        self.c_sq += float(clean.pow(2).sum())
        self.diff_max = max(self.diff_max, float(residual.abs().max()))
        self.clean_max = max(self.clean_max, float(clean.abs().max()))

    @staticmethod
    def _std(total: float, squares: float, n: int) -> float:
        if n < 2:
            return 0.0
        return float(max(squares - total * total / n, 0.0) / (n - 1)) ** 0.5

    def named(self, candidate: Candidate, tol: float, positions: torch.Tensor, sampled: int, rows: int) -> Named:
        distance = self.diff_max / max(self.clean_max, 1e-12)
        return Named(candidate, distance, distance <= tol, self._std(self.r_sum, self.r_sq, self.n),
                     self._std(self.c_sum, self.c_sq, self.n), positions, sampled, rows)


def _pick(scored: list[tuple[float, Candidate]]) -> Candidate:
    """The lowest error, a tie (within `TIE`) keeping the earlier candidate: the order given is plainest first."""
    best = None
    for err, candidate in scored:
        if best is None or err < best[0] * (1 - TIE):
            best = (err, candidate)
    return best[1]


def name_hidden(rows: torch.Tensor, cands: TargetCandidates, tol: float,
                positions: torch.Tensor | None = None) -> Named:
    """`rows` [r, hidden] named by the target's hidden candidate whose rows (at `positions`, or each row's nearest)
    are closest."""
    if rows.shape[-1] != cands.hidden_size:
        return Named(None, float("inf"), False)
    return name_among(rows.to(cands.device), {c: (lambda c=c: cands.hidden(c)) for c in cands.hidden_candidates()},
                      tol, positions)


def name_among(rows: torch.Tensor, tables: dict[Candidate, Callable[[], torch.Tensor]], tol: float,
               positions: torch.Tensor | None = None) -> Named:
    """`rows` [r, width] named by the candidate whose table (made by its function when scored, one at a time) is
    closest at `positions`, or at each row's nearest: decided on a spread sample of the rows, confirmed on every
    row. Tables of another width are no candidate."""
    rows = rows.float()
    sample = spread_sample(rows.shape[0]).to(rows.device)
    scored = []
    for candidate, make in tables.items():
        table = make()
        if table.shape[-1] != rows.shape[-1]:
            continue
        table = table.to(rows.device)
        if positions is not None:
            err = float((rows[sample] - table[positions.to(table.device)[sample]]).pow(2).mean())
        else:
            err = float(_nearest(rows[sample], table)[1].mean()) / rows.shape[-1]
        scored.append((err, candidate))
        del table
    if not scored:
        return Named(None, float("inf"), False)
    winner = _pick(scored)
    table = tables[winner]().to(rows.device)
    found = positions.to(table.device) if positions is not None else _nearest(rows, table)[0]
    moments = _Moments()
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        part = slice(start, start + CHUNK_ROWS)
        moments.add(rows[part], table[found[part]])
    return moments.named(winner, tol, found.cpu(), len(sample), rows.shape[0])


def name_logits(rows: torch.Tensor, cands: TargetCandidates, tol: float) -> Named:
    """`rows` [r, vocab] (logits, log-probabilities or probabilities; centred log-probabilities are compared) named by
    the logits candidate nearest them, each row at its nearest position: decided on a spread sample, the nearest
    positions found in the hidden space, near-ties settled through the real head, the winner confirmed on every
    row."""
    if rows.shape[-1] != cands.vocab:
        return Named(None, float("inf"), False)
    sample = spread_sample(rows.shape[0])
    y = centered_log_probs(rows[sample]).to(cands.device)
    scored, found = [], {}
    projected = project(y, cands)  # y W once: every candidate's search reads it
    for candidate in cands.logit_candidates():
        pos, err = LogitSearch(cands, candidate).nearest(y, projected)
        scored.append((err, candidate))
        found[candidate] = pos
    # The search's errors rank the candidates; those near the best are compared exactly, through the head.
    floor = min(err for err, _ in scored)
    margin = 1.5 * floor + 1e-5 * float(y.pow(2).mean())
    exact = []
    for err, candidate in scored:
        if err <= margin:
            picked = centered_log_probs(cands.logits(candidate, found[candidate]))
            exact.append((float((y - picked).pow(2).mean()), candidate))
    winner = _pick(exact)
    del y
    search = LogitSearch(cands, winner)
    positions = []
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        if start == 0 and rows.shape[0] <= len(sample):  # every row was the sample: its search stands
            positions.append(found[winner])
            break
        positions.append(search.nearest(centered_log_probs(rows[start:start + CHUNK_ROWS]).to(cands.device))[0])
    positions = torch.cat(positions)
    moments = _Moments()
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        part = slice(start, start + CHUNK_ROWS)
        moments.add(centered_log_probs(rows[part]).to(cands.device),
                    centered_log_probs(cands.logits(winner, positions[part])))
    return moments.named(winner, tol, positions, len(sample), rows.shape[0])


class LogitSearch:
    """Each centred row's nearest position among one candidate's logits, without making them: |y - W_c h - b_c|^2
    from y W, the head's Gram matrix and the head's input at every position (a head that is no plain linear: its
    logits, every position, in chunks)."""

    def __init__(self, cands: TargetCandidates, candidate: Candidate):
        self.cands, self.candidate = cands, candidate
        self.gram = cands.gram()
        self.bias = cands.centred_bias()
        if self.gram is not None:
            self.h = cands.head_input(candidate)  # [positions, hidden]
            self.quadratic = ((self.h @ self.gram) * self.h).sum(-1)  # |W_c h|^2 per position

    def nearest(self, y: torch.Tensor, projected: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """(each row's nearest position, the mean squared error per logit there) for centred rows y [r, vocab];
        `projected`: their `project(y, cands)`, where already made."""
        if self.gram is None:
            best = torch.full((y.shape[0],), float("inf"), device=y.device)
            index = torch.zeros(y.shape[0], dtype=torch.long, device=y.device)
            for part, logits in self.cands.logit_chunks(self.candidate, torch.arange(self.cands.positions)):
                values, at = torch.cdist(y, centered_log_probs(logits)).pow(2).min(1)
                better = values < best
                best, index = torch.where(better, values, best), torch.where(better, at + part.start, index)
            return index.cpu(), float(best.mean()) / y.shape[-1]
        if self.bias is not None:  # the centred logits are W_c h + b_c
            y = y - self.bias.to(y.device)
        u = projected if projected is not None else project(y, self.cands)
        d = y.pow(2).sum(-1, keepdim=True) - 2 * u @ self.h.T + self.quadratic[None]
        values, at = d.min(1)
        return at.cpu(), float(values.clamp_min(0).mean()) / y.shape[-1]


def project(y: torch.Tensor, cands: TargetCandidates) -> torch.Tensor | None:
    """(y - b_c) W for centred rows y [r, vocab] and the head's weight W [vocab, hidden], float32, in vocabulary
    chunks (y is centred, so y W_c = y W); None where the head is no plain linear."""
    if cands.gram() is None:
        return None
    bias = cands.centred_bias()
    if bias is not None:
        y = y - bias.to(y.device)
    weight = cands.head.weight.detach()
    out = torch.zeros(y.shape[0], weight.shape[1], device=y.device)
    for start in range(0, weight.shape[0], 16384):
        out += y[:, start:start + 16384] @ weight[start:start + 16384].float()
    return out
