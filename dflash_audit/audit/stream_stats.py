"""Statistics of two tensors read in chunks: max |a - b|, cosine similarity, finiteness.

A 3.46 GB drafter holds tensors of 262 MB (bf16); a float64 copy of one is 1 GB. Here each
tensor is visited in chunks of CHUNK elements, converted to float64 one chunk at a time, and
reduced into float64 accumulators, so the extra memory is a few chunks whatever the tensor's
size; a tensor read through mmap is paged in from its file and never copied whole.

Equal tensors (bitwise, `torch.equal`) skip the arithmetic: their difference is 0 and their
cosine 1. Finiteness is read with one min/max pass (`torch.aminmax` propagates NaN and an
infinity surfaces as the min or the max), without a boolean copy of the tensor.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

CHUNK = 1 << 22  # elements: 32 MB as float64


@dataclass(frozen=True)
class PairStats:
    max_abs_diff: float
    cosine: float  # clamped to [-1, 1]
    finite_a: bool = True  # no NaN / inf in a
    finite_b: bool = True
    relative_error: float = 0.0  # |a - b| / |b| (Frobenius): what a quantization of b costs


@torch.no_grad()
def is_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in a tensor (True for non-float tensors)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), 1 << 26):  # aminmax needs no temporary; chunks only bound one call
        low, high = torch.aminmax(flat[start:start + (1 << 26)])
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            return False
    return True


def clamp_cosine(dot: float, norm_a_sq: float, norm_b_sq: float, identical: bool) -> float:
    """dot / (|a| |b|) in [-1, 1]; rounding may push it past 1. Zero vectors: 1 if identical, else 0."""
    norm = math.sqrt(norm_a_sq) * math.sqrt(norm_b_sq)
    if not norm > 0:
        return 1.0 if identical else 0.0
    return min(1.0, max(-1.0, dot / norm))


@torch.no_grad()
def pair_stats(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK) -> PairStats:
    """Max |a - b|, cosine and finiteness of two same-shape tensors, in float64, one chunk at a time.

    A NaN anywhere makes the difference NaN (as a whole-tensor max would)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.numel() == 0:
        return PairStats(0.0, 1.0)
    if a.dtype == b.dtype and torch.equal(a, b):
        finite = is_finite(a)  # bitwise equal: b is finite exactly when a is
        if finite:
            return PairStats(0.0, 1.0)
    finite_a, finite_b = is_finite(a), is_finite(b)
    diff, dot, norm_a, norm_b, error = 0.0, 0.0, 0.0, 0.0, 0.0
    for start in range(0, a.numel(), chunk):
        x, y = a[start:start + chunk].double(), b[start:start + chunk].double()
        delta = x - y
        part = float(delta.abs().max())
        diff = math.nan if math.isnan(part) or math.isnan(diff) else max(diff, part)
        dot += float(x @ y)
        norm_a += float(x @ x)
        norm_b += float(y @ y)
        error += float(delta @ delta)
    relative = math.sqrt(error / norm_b) if norm_b > 0 else (0.0 if error == 0 else math.inf)
    return PairStats(diff, clamp_cosine(dot, norm_a, norm_b, identical=diff == 0.0), finite_a, finite_b, relative)


def stats_all(pairs: dict[Any, tuple[torch.Tensor, torch.Tensor]], singles: dict[Any, torch.Tensor],
              workers: int | None = None) -> tuple[dict[Any, PairStats], dict[Any, bool]]:
    """`pair_stats` of many pairs and `is_finite` of single tensors (those with no same-shape partner), two at a
    time on a machine with two cores: torch releases the GIL inside each reduction, so the jobs overlap. The
    largest go first, so that no worker is left alone with a long one at the end; memory stays a few chunks per
    worker."""
    jobs = [((True, key), pair_stats, ab, ab[0].numel()) for key, ab in pairs.items()]
    jobs += [((False, key), is_finite, (tensor,), tensor.numel()) for key, tensor in singles.items()]
    jobs.sort(key=lambda job: -job[3])
    workers = workers or min(2, os.cpu_count() or 1)
    if workers <= 1 or len(jobs) <= 1:
        results = [function(*args) for _, function, args, _ in jobs]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda job: job[1](*job[2]), jobs))
    done = {job[0]: result for job, result in zip(jobs, results)}
    return ({key: done[True, key] for key in pairs}, {key: done[False, key] for key in singles})
