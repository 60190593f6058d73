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
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=1e-1, rtol=5e-2),
}

# DFlash2 in fp32. Each convolution's kernel is projected from the activations it multiplies, so
# every sublayer is quadratic in its input and each of the two convolutions per sublayer (four per
# layer) multiplies the rounding differences of two operation orders (z-lab: base * x, then
# addcmul(delta, x); speculators: (base + delta) * x). Measured: 1.9e-5 after 3 layers of K = 3
# taps, where the same drafter in fp64 differs by exactly 0. So fp32 gets 1e-4 (still three orders
# below a real bug, which moves values by O(0.1..1)), and every DFlash2 forward check also runs in
# fp64, where the functions must agree to 1e-10. Not in bf16: there the same amplification of a
# 1-ulp difference reaches O(0.1), the size of a bug, so a bf16 check could not tell them apart.
DFLASH2_FP32 = Tolerance(atol=1e-4, rtol=1e-4)


def for_dtype(dtype: torch.dtype) -> Tolerance:
    return BY_DTYPE[dtype]


def for_drafter(spec, dtype: torch.dtype) -> Tolerance:
    """The tolerance of a drafter's forward outputs: `for_dtype`, except DFlash2 in fp32."""
    return DFLASH2_FP32 if spec.family == "dflash2" and dtype == torch.float32 else BY_DTYPE[dtype]
