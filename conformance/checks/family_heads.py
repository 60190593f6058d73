"""DSpark's Markov and confidence heads (#37) and XPress's refiner (#38): the heads' teacher-forced forward and
the decoding rounds they drive, on identical weights and inputs."""

from __future__ import annotations

import torch

from conformance.comparator import Comparator
from conformance.plug import require
from conformance.strategies import HeadCase
from conformance.tolerances import EXACT, for_dtype
from conformance.world import VOCAB, reference_state_dict, target_for

FP32 = for_dtype(torch.float32)


def _drafter(impl, case: HeadCase):
    return impl.build_drafter(case.spec, reference_state_dict(case.spec, case.seed), target_for(case.spec))


def _inputs(case: HeadCase):
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.num_blocks, case.spec.block_size)
    hidden = torch.randn(*shape, case.spec.hidden_size, generator=gen)
    return torch.randint(0, VOCAB, shape, generator=gen), hidden, 0.5 * torch.randn(1, case.spec.block_size, VOCAB,
                                                                                generator=gen)


def _where(case: HeadCase) -> str:
    spec = case.spec
    own = (f"rank {spec.markov_rank} {spec.markov_head_type}" if spec.family == "dspark" else
           f"rank {spec.xpress_rank}, MLP x{spec.xpress_mlp_ratio}, {spec.num_jacobi_passes} passes")
    return f"{own}, {case.num_blocks} blocks of {spec.block_size}, sample_from_anchor {spec.sample_from_anchor}"


def head_forward(cmp: Comparator, a, b, case: HeadCase, operations: tuple[str, ...]) -> None:
    prev, hidden, _ = _inputs(case)

    def run(impl, operation):
        require(impl, operation)
        with torch.no_grad():
            return getattr(impl, operation)(_drafter(impl, case), prev, hidden)

    for operation in operations:
        cmp.compare((a.name, b.name), lambda op=operation: run(a, op), lambda op=operation: run(b, op), FP32,
                    what=f"{operation.replace('_', ' ')}, {_where(case)}")


def decoding_round(cmp: Comparator, a, b, case: HeadCase, operation: str) -> None:
    """One whole block's greedy proposals: DSpark's chain left to right, XPress's Jacobi passes."""
    _, hidden, base = _inputs(case)
    hidden = hidden[:1]

    def run(impl):
        require(impl, operation)
        with torch.no_grad():
            drafter = _drafter(impl, case)
            if operation == "markov_path":
                return impl.markov_path(drafter, hidden, base, case.anchor)
            return impl.jacobi_tokens(drafter, hidden, base, case.anchor, case.before_anchor)

    cmp.compare((a.name, b.name), lambda: run(a), lambda: run(b), EXACT,
                what=f"{'Markov chain' if operation == 'markov_path' else 'Jacobi'} proposals of a block, {_where(case)}")
