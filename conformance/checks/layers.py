"""Target-layer selection (#1), hidden-state index convention (#2) and fc dimensions (#4)."""

from __future__ import annotations

import tempfile
from functools import lru_cache

import torch

from conformance.comparator import Comparator
from conformance.tolerances import for_dtype
from conformance.world import VOCAB, reference_state_dict, target_for, tiny_target
from impl.layers import names_final_layer


def default_layer_ids(cmp: Comparator, a, b, case: tuple[int, int]) -> None:
    num_target_layers, num_draft_layers = case
    cmp.compare((a.name, b.name),
                lambda: a.default_target_layer_ids(num_target_layers, num_draft_layers),
                lambda: b.default_target_layer_ids(num_target_layers, num_draft_layers),
                what=f"default ids for N={num_target_layers}, n={num_draft_layers}")


@lru_cache(maxsize=16)
def target_hidden_states(num_target_layers: int, hidden: int, length: int = 5):
    """The `hidden_states` tuple of a real tiny target (N + 1 entries)."""
    ids = torch.arange(length)[None] % VOCAB
    with torch.no_grad():
        return tiny_target(num_target_layers, hidden)(ids, output_hidden_states=True).hidden_states


def context_feature_indexing(cmp: Comparator, a, b, case: tuple[int, int, list[int]]) -> None:
    num_target_layers, hidden, layer_ids = case
    hs = target_hidden_states(num_target_layers, hidden)
    cmp.compare((a.name, b.name), lambda: a.context_features(hs, layer_ids),
                lambda: b.context_features(hs, layer_ids), what=f"context features of z-lab ids {layer_ids}")


def converter_convention(cmp: Comparator, case: tuple[int, list[int]]) -> list[int]:
    """speculators' converter renames z-lab ids; the layers it then reads must be the ones z-lab reads."""
    from dflash.model import extract_context_feature
    from speculators.convert.dflash import DFlashConverter

    num_target_layers, layer_ids = case
    target = tiny_target(num_target_layers, 32)
    source = {"hidden_size": 32, "vocab_size": VOCAB, "num_hidden_layers": 1, "block_size": 4,
              "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": 0}}
    with tempfile.TemporaryDirectory() as verifier_dir:
        target.config.save_pretrained(verifier_dir)
        aux = DFlashConverter()._build_config(source, verifier_dir, None).aux_hidden_state_layer_ids
    hs = target_hidden_states(num_target_layers, 32)
    kept = [i for i in layer_ids if not names_final_layer(i, num_target_layers)]  # the converter drops it
    # speculators indexes hidden_states with its aux ids directly.
    cmp.compare(("speculators", "zlab"), torch.cat([hs[j] for j in aux], -1),
                extract_context_feature(hs, kept),
                what=f"converter aux ids {aux} for z-lab ids {layer_ids}")
    return aux


def fc_dims(cmp: Comparator, a, b, case) -> None:
    """Both built from the reference's state dict; `hidden_norm(fc(features))` on every selected layer."""
    spec, dtype = case
    state = reference_state_dict(spec)
    target = target_for(spec)
    # Width from the reference rule (every selected layer feeds fc), not from the spec under test.
    features = torch.randn(1, 5, len(spec.target_layer_ids) * spec.hidden_size,
                           generator=torch.Generator().manual_seed(1))

    def project(impl):
        drafter = impl.build_drafter(spec, state, target)
        return impl.project_context(drafter.to(dtype), features.to(dtype))

    cmp.compare((a.name, b.name), lambda: project(a), lambda: project(b), for_dtype(dtype),
                what=f"hidden_norm(fc(.)) over {len(spec.target_layer_ids)} layers x H={spec.hidden_size}")

