"""DFlash2: the convolution pair (#22), the selector's scores and path (#23), its training candidates
and loss (#24), on identical weights and inputs."""

from __future__ import annotations

import functools

import torch

from conformance.checks import training
from conformance.comparator import Comparator
from conformance.strategies import ConvCase, SelectorCase, SelectorLossCase, TrainingCase
from conformance.tolerances import EXACT, for_drafter, for_dtype
from conformance.world import VOCAB, reference_state_dict, target_for

FP32 = for_dtype(torch.float32)


def _drafter(impl, spec, seed):
    return impl.build_drafter(spec, reference_state_dict(spec, seed), target_for(spec))


def conv_taps(cmp: Comparator, a, b, case: ConvCase) -> None:
    """Both sides of one sublayer's convolution pair on blocks of random activations."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (1, case.num_blocks * case.spec.block_size, case.spec.hidden_size)
    x, y = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)

    @functools.cache  # one run per implementation serves both comparisons
    def run(impl):
        with torch.no_grad():
            return impl.dynamic_conv(_drafter(impl, case.spec, case.seed), case.layer, case.sublayer, x, y,
                                     case.spec.block_size)

    where = (f"layer {case.layer} {case.sublayer}_conv, K={case.spec.conv_kernel_size}, "
             f"group {case.spec.conv_group_size}, {case.num_blocks} blocks of {case.spec.block_size}")
    names = (a.name, b.name)
    cmp.compare(names, lambda: run(a)[0], lambda: run(b)[0], FP32, what=f"input-side convolution, {where}")
    cmp.compare(names, lambda: run(a)[1], lambda: run(b)[1], FP32,
                what=f"output-side convolution (delta from the input), {where}")


def _selector_inputs(case: SelectorCase):
    gen = torch.Generator().manual_seed(case.seed)
    hidden = torch.randn(1, case.slots, case.spec.hidden_size, generator=gen)
    logits = 3 * torch.randn(1, case.slots, VOCAB, generator=gen)
    return hidden, logits


def selector_path(cmp: Comparator, a, b, case: SelectorCase) -> None:
    """The path through one block: tokens, the candidate set of each slot and (sampled) its distribution."""
    hidden, logits = _selector_inputs(case)

    def run(impl):
        with torch.no_grad():
            tokens, candidates, probs = impl.selector_path(_drafter(impl, case.spec, case.seed), hidden, logits,
                                                            case.first_token, case.temperature, case.seed)
        # Candidates come in `topk(sorted=False)` order: compare sets, and probabilities by candidate.
        order = candidates.argsort(-1)
        probs = None if probs is None else probs.gather(-1, order)
        return tokens, candidates.gather(-1, order), probs

    names, where = (a.name, b.name), f"{case.slots} slots, top-{case.spec.selector_top_k}, T={case.temperature}"
    outputs = {}
    for impl in (a, b):  # through the comparator: an error is a divergence, a call the plug cannot take a mismatch
        ok, outputs[impl.name] = cmp.run(names, lambda impl=impl: run(impl), what=f"{impl.name} selector path")
        if not ok:
            return
    cmp.compare(names, outputs[a.name][1], outputs[b.name][1], EXACT, what=f"candidate sets, {where}")
    cmp.compare(names, outputs[a.name][0], outputs[b.name][0], EXACT, what=f"selected path, {where}")
    if case.temperature > 0:
        cmp.compare(names, outputs[a.name][2], outputs[b.name][2], FP32,
                    what=f"sampling distribution over the candidates, {where}")


def selector_scores(cmp: Comparator, a, b, case: SelectorCase) -> None:
    """Scores of given candidates under given predecessors (the training-time scoring)."""
    hidden, logits = _selector_inputs(case)
    gen = torch.Generator().manual_seed(case.seed + 1)
    predecessors = torch.randint(0, VOCAB, (1, case.slots), generator=gen)
    candidates = logits.topk(case.spec.selector_top_k, dim=-1).indices

    def run(impl):
        with torch.no_grad():
            return impl.selector_scores(_drafter(impl, case.spec, case.seed), logits, hidden, predecessors, candidates)

    cmp.compare((a.name, b.name), lambda: run(a), lambda: run(b), FP32,
                what=f"candidate scores, {case.slots} slots, top-{case.spec.selector_top_k}")


def training_candidates(cmp: Comparator, a, b, case: SelectorLossCase) -> None:
    """Candidates with a missing target swapped in last, label positions, and which slots had it."""
    gen = torch.Generator().manual_seed(case.seed)
    n = case.num_anchors * case.block_size
    logits = torch.randn(1, n, VOCAB, generator=gen)
    candidate_ids = logits.topk(case.top_k, dim=-1).indices
    # Targets: about half inside the top-k (at any rank), the rest anywhere in the vocabulary.
    inside = candidate_ids.gather(-1, torch.randint(0, case.top_k, (1, n, 1), generator=gen))[..., 0]
    target_ids = torch.where(torch.rand(1, n, generator=gen) < 0.5, inside,
                             torch.randint(0, VOCAB, (1, n), generator=gen))
    names, results = (a.name, b.name), {}
    for impl in (a, b):
        ok, results[impl.name] = cmp.run(names, lambda impl=impl: impl.selector_training_candidates(
            candidate_ids, target_ids), what=f"{impl.name} selector training candidates")
        if not ok:
            return
    for index, what in enumerate(("training candidates", "label positions", "target in the unary top-k")):
        cmp.compare(names, results[a.name][index], results[b.name][index], EXACT,
                    what=f"{what}, {n} slots, top-{case.top_k}")


def selector_loss(cmp: Comparator, a, b, case: SelectorLossCase) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    n = case.num_anchors * case.block_size
    scores = 3 * torch.randn(1, n, case.top_k, generator=gen)
    labels = torch.randint(0, case.top_k, (1, n), generator=gen)
    mask = (torch.rand(1, n, generator=gen) < 0.8).float()
    mask[:, ::case.block_size] = 0  # slot 0 is the anchor: never trained
    args = (scores, labels, mask, case.block_size, case.gamma, case.weighting, case.alpha)
    cmp.compare((a.name, b.name), lambda: a.selector_loss(*args), lambda: b.selector_loss(*args), FP32,
                what=f"selector loss, {case.weighting}, B={case.block_size}, top-{case.top_k}")


def selector_training(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """One DFlash2 training forward: the selector's teacher-forced predecessors, candidates and scores."""
    outs = training.on_reference_anchors(cmp, a, b, case)  # anchors are #8's: both train on the reference's
    if outs is None:
        return
    selectors = [out.get("selector") for out in outs]
    valid = outs[1].anchor_valid.reshape(-1).repeat_interleave(case.spec.block_size)  # padded blocks train nothing
    for field, tolerance in (("predecessors", EXACT), ("candidates", EXACT), ("label_positions", EXACT),
                             ("contains_target", EXACT), ("scores", for_drafter(case.spec, torch.float32))):
        cmp.compare((a.name, b.name), getattr(selectors[0], field)[:, valid], getattr(selectors[1], field)[:, valid],
                    tolerance, what=f"selector {field.replace('_', ' ')} of the valid anchor blocks of a training forward")
