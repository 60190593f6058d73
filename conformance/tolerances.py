"""Comparison tolerances, per dtype, in one place.

Exact operations (masks, token and layer ids, anchor draws, loss-weight schedules,
acceptance lengths) are compared with `EXACT`: the references compute them with the same
integer or elementwise float ops, so any difference is a different rule, never rounding.

Floating-point paths (fc, attention, draft forward, losses) may legitimately differ in
summation order (SDPA vs eager attention, fused vs split projections):
- fp32: 24-bit mantissa, eps 1.2e-7. A tiny drafter (<= 6 layers, H <= 64) accumulates a
  few hundred ulps through normed O(1) activations, so 1e-5 absolute + 1e-5 relative sits
  two orders of magnitude above rounding noise and three below any real bug (a wrong
  roll, mask or position moves values by O(0.1..1)).
- bf16: 8-bit mantissa, eps 7.8e-3. Every matmul output is rounded to bf16, so two
  orderings differ by ~1 ulp per op at values up to ~4 (0.03); over <= 6 layers that is
  bounded by 6e-2 absolute, 2e-2 relative, still well under the O(0.3+) shifts that the
  planted bugs cause in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0


EXACT = Tolerance(atol=0.0, rtol=0.0)

BY_DTYPE = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=6e-2, rtol=2e-2),
}


def for_dtype(dtype: torch.dtype) -> Tolerance:
    return BY_DTYPE[dtype]
