"""The one near-tie rule: when a drafter decision that parts two computations of the same drafter is no defect.

Two computations of one drafter's decision part without a defect only where its top two candidates are closer than
what separates the computations. Every place that judges a parting by it calls `near_tie`: the offline replay
against our live loop (`impl/offline/walks.py` `explain_parting` / `unexplained_partings`, the rule the tests and
the benches judge by), a serving engine against the audit's replay (`dflash_audit/rounds/by_value.py`,
`dflash_audit/rounds/ties.py`) and a team's evaluator against z-lab's loop (`dflash_audit/trace/evaluation/why.py`).

- **float32**: the inputs agree to a few float32 ulps; what parts two computations is their kernels. Our own two
  loops run the same torch kernels, so none of their partings is a tie (the walks agree on every test). Another
  implementation's kernels (an engine's, a batched evaluator's) sum in other orders: their logits part by about
  1e-4 on the test world, so two candidates closer than `KERNEL_MARGIN` may come out in either order.
- **below float32**: the drafter's inputs themselves are rounded apart (the target's states computed in another
  shape of forward, one query against a KV cache, a padded batch row, a verified block, are within
  `ROUNDING_ULPS` ulps of the dtype at each layer's scale). A decision is a near-tie when both sides' inputs are
  within that rounding of each other and its gap is within what their difference moves the drafter's scores (twice
  the most it moves them, measured by running the drafter on each side's inputs). Where a side's inputs are not
  known (an engine with no hook) nothing is measured and no parting is called a tie.
"""

from __future__ import annotations

import torch

# float32: two kernels summing one drafter's logits in other orders part by about 1e-4 on the test world.
KERNEL_MARGIN = 1e-3
# A target state computed in another shape of forward is within this many ulps of its dtype at its layer's scale.
ROUNDING_ULPS = 8


def ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """The largest difference of `a` and `b` in ulps of `dtype` (default `b`'s) at their common scale."""
    eps = torch.finfo(dtype or b.dtype).eps
    scale = float(torch.maximum(a.abs().max(), b.abs().max())) * eps
    return float((a.float() - b.float()).abs().max()) / scale if scale else 0.0


def near_tie(margin: float | None, dtype: torch.dtype, moved: float | None = None, ulps: float | None = None,
             same_kernels: bool = False) -> bool:
    """Whether a decision whose top two are `margin` apart may part two computations of one drafter in `dtype`
    without a defect. float32: only between other kernels (`same_kernels` False), within KERNEL_MARGIN. Below it:
    the two sides' inputs `ulps` apart (at most ROUNDING_ULPS) and `margin` within `moved`, twice the most their
    difference moves the decision's scores; unmeasured (None) is no tie."""
    if margin is None:
        return False
    if dtype == torch.float32:
        return not same_kernels and margin < KERNEL_MARGIN
    return moved is not None and ulps is not None and ulps <= ROUNDING_ULPS and margin <= moved
