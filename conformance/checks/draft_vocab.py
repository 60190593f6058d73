"""Checks of a reduced draft vocabulary (#32): the mapping built from token frequencies, the training targets
and logits restricted to it, and the target ids a drafter proposes through its head and `d2t`.

Every implementation gets the same real target, the reference's draft-body weights plus the draft head (the
target head's rows of the mapped ids, as speculators' `load_verifier_weights` takes them) and the same `d2t`."""

from __future__ import annotations

import dataclasses

import torch

from conformance.checks.forward import ForwardCase, inputs
from conformance.checks.training import FP32
from conformance.comparator import Comparator
from conformance.strategies import TrainingCase
from conformance.tolerances import EXACT
from conformance.world import packed_sequence, reference_state_dict, target_for
from impl.vocab_mapping import count_token_frequencies, mapping_from_frequencies, target_ids


def case_frequencies(case: TrainingCase) -> dict[int, int]:
    """Token frequencies of the case's packed documents (loss-masked tokens), as a trainer counts them."""
    input_ids, loss_mask, _ = packed_sequence(list(case.lengths), case.padding, case.seed)
    return count_token_frequencies(zip(input_ids, loss_mask))


def reduced_state_dict(spec, seed: int) -> dict[str, torch.Tensor]:
    """The reference's draft body plus the reduced head and its map, for a spec with `draft_vocab_size`."""
    full = dataclasses.replace(spec, draft_vocab_size=None)
    state = reference_state_dict(full, seed)
    gen = torch.Generator().manual_seed(seed)
    freq = {i: int(n) for i, n in enumerate(torch.randint(0, 5, (spec.target_vocab_size,), generator=gen).tolist()) if n}
    d2t = mapping_from_frequencies(freq, spec.draft_vocab_size, spec.target_vocab_size)
    head = target_for(spec).lm_head.weight.detach()
    return {**state, "lm_head.weight": head[target_ids(d2t)].clone(), "d2t": d2t}


def mapping_construction(cmp: Comparator, a, b, case: TrainingCase) -> None:
    names = (a.name, b.name)
    freq, size = case_frequencies(case), case.spec.draft_vocab_size
    ok_a, out_a = cmp.run(names, lambda: a.vocab_mapping(freq, size, case.spec.target_vocab_size), what="vocab mapping")
    ok_b, out_b = cmp.run(names, lambda: b.vocab_mapping(freq, size, case.spec.target_vocab_size), what="vocab mapping")
    if ok_a and ok_b:
        cmp.compare(names, out_a[0], out_b[0], EXACT, what="d2t (offsets) from the data's token frequencies")
        cmp.compare(names, out_a[1], out_b[1], EXACT, what="t2d (mask of the mapped target ids)")


def _run(impl, case: TrainingCase, anchors=None):
    spec = case.spec
    target = target_for(spec)
    input_ids, loss_mask, document_ids = packed_sequence(list(case.lengths), case.padding, case.seed)
    drafter = impl.build_drafter(spec, reduced_state_dict(spec, case.seed), target)
    given = {} if anchors is None else {"anchors": anchors}
    with torch.no_grad():
        return impl.training_outputs(drafter, target, input_ids, loss_mask, document_ids, case.max_anchors, case.seed,
                                     **given)


def restricted_training(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Targets and logits of a training forward live in the draft vocabulary (the verifier head's mapped rows)."""
    names = (a.name, b.name)
    ok, out_b = cmp.run(names, lambda: _run(b, case), what="training forward, reduced draft vocabulary")
    if not ok:
        return
    ok, out_a = cmp.run(names, lambda: _run(a, case, (out_b.anchors, out_b.anchor_valid)),
                        what="training forward on the reference's anchors, reduced draft vocabulary")
    if not ok:
        return
    valid = out_b.anchor_valid.reshape(-1).repeat_interleave(case.spec.block_size)
    size = case.spec.draft_vocab_size
    cmp.compare(names, lambda: out_a.get("targets")[:, valid], lambda: out_b.get("targets")[:, valid], FP32,
                what=f"training targets over the {size}-token draft vocabulary (valid anchor blocks)")
    cmp.compare(names, out_a.logits[:, valid], out_b.logits[:, valid], FP32,
                what=f"training logits over the {size}-token draft vocabulary (valid anchor blocks)")


def proposals(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Each implementation's own draft forward on one block after a context, then the target ids it proposes
    from the reference's hidden states through its head and d2t offsets (ids exactly: the map is no float)."""
    names = (a.name, b.name)
    # Full attention from position 0: the plain forward (#10); windows and positions are other entries' checks.
    spec = dataclasses.replace(case.spec, layer_types=("full_attention",) * case.spec.num_hidden_layers,
                               sliding_window=None, sliding_window_non_causal=False)
    target, noise, features, positions = inputs(ForwardCase(spec, 6, 0, torch.float32, case.seed))
    state = reduced_state_dict(spec, case.seed)
    drafters = {}
    for impl in (a, b):
        ok, drafters[impl.name] = cmp.run(names, lambda impl=impl: impl.build_drafter(spec, state, target),
                                          what="drafter with a reduced draft vocabulary")
        if not ok:
            return
    hidden = {}
    for impl in (a, b):
        ok, hidden[impl.name] = cmp.run(names, lambda impl=impl: impl.draft_forward(
            drafters[impl.name], noise, features, positions)[:, 1:], what="draft forward")
        if not ok:
            return
    cmp.compare(names, hidden[a.name], hidden[b.name], FP32, what="draft hidden states of the block's slots 1..")
    ids = {}
    for impl in (a, b):
        ok, ids[impl.name] = cmp.run(names, lambda impl=impl: impl.proposed_ids(drafters[impl.name], hidden[b.name],
                                                                                target), what="proposed target ids")
        if not ok:
            return
    cmp.compare(names, ids[a.name], ids[b.name], EXACT, what="target ids proposed through the draft head and d2t")
