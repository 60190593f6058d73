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
- bf16: 8-bit mantissa, eps 7.8e-3. Every op output is rounded to bf16, so two kernel
  orderings (SDPA vs eager attention) differ by up to 1 ulp per op at values up to ~4
  (0.0156); ~10 rounded ops per layer over <= 6 layers random-walk to sqrt(60) * 0.0156
  ~ 0.12. Hence 1e-1 absolute + 5e-2 relative (measured: 0.07 at 6 layers). Planted bugs
  are judged in fp32, where they move values by orders of magnitude more.
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
    torch.bfloat16: Tolerance(atol=1e-1, rtol=5e-2),
}


def for_dtype(dtype: torch.dtype) -> Tolerance:
    return BY_DTYPE[dtype]
