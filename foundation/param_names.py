"""Parameter names: the wrapper prefixes a trainer puts in front of a drafter's own names.

One table and one strip loop for every reader (our `ckpt.pt`, z-lab and speculators folders,
the adapters, foreign checkpoints). Each prefix is the attribute or wrapper a real trainer
saves its drafter under:
- `module.`: `DistributedDataParallel` / `DataParallel` (`model.module`);
- `_orig_mod.`: `torch.compile`'s `OptimizedModule`;
- `model.`: trainers that hold the network as `self.model` (Lightning modules, HF `Trainer` wrappers);
- `draft_model.`: SpecForge's `OnlineDFlashModel.draft_model` and speculators-style training wrappers;
- `drafter.`: training modules that keep the draft network as `self.drafter`.
None of them begins a canonical drafter name (`fc.`, `layers.`, `norm.`, `hidden_norm.`,
`candidate_selector.`, the verifier-owned `embed_tokens.`/`lm_head.`...), so stripping never eats
a real name; tests/test_restatements.py fails on a second copy of this tuple.
"""

from __future__ import annotations

from foundation.errors import CheckpointError

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "draft_model.", "drafter.")
# Tensors a speculators drafter holds that are copies of the verifier's (embeddings, head, final
# norm, vocabulary maps): never trained, never draft body (PITFALLS #13).
VERIFIER_OWNED_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                       "t2d", "d2t")
# A drafter with a reduced draft vocabulary owns its head and its map to target ids (speculators saves them as
# draft weights; vLLM loads them from the drafter): draft body then, not verifier copies. `t2d` stays a copy:
# it is implied by `d2t`.
DRAFT_VOCAB_KEYS = ("lm_head.weight", "d2t")


def verifier_owned_keys(reduced_vocab: bool) -> tuple[str, ...]:
    """The verifier-owned tensor names of a drafter with (or without) a reduced draft vocabulary."""
    return tuple(k for k in VERIFIER_OWNED_KEYS if not (reduced_vocab and k in DRAFT_VOCAB_KEYS))


def strip_wrapper_prefix(name: str) -> str:
    """`name` behind any stack of wrapper prefixes (`module._orig_mod.fc.weight` -> `fc.weight`);
    a name that is nothing but a prefix is kept."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix) and len(name) > len(prefix):
                name, changed = name[len(prefix):], True
    return name


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    """Names without wrapper prefixes; two names that become one are an error, never collapsed."""
    cleaned, origin = {}, {}
    for raw, value in state_dict.items():
        key = strip_wrapper_prefix(raw)
        if key in cleaned:
            raise CheckpointError(f"tensors {origin[key]!r} and {raw!r} are both {key!r} once wrapper prefixes "
                                  "are removed; keep one")
        cleaned[key], origin[key] = value, raw
    return cleaned


# -- DFlash2 codebooks: one tensor, two spellings ---------------------------------------------------------
# z-lab's `save_pretrained` writes its selector Embeddings as `candidate_selector.*_codebook.weight`;
# its published files and speculators write the bare name (which z-lab's `from_pretrained` maps back).
CODEBOOK_MODULE_SUFFIX = "_codebook.weight"


def codebook_name(key: str) -> str:
    """A DFlash2 selector codebook's one (bare) name; every other name unchanged."""
    if key.startswith("candidate_selector.") and key.endswith(CODEBOOK_MODULE_SUFFIX):
        return key.removesuffix(".weight")
    return key


def codebook_module_name(key: str) -> str:
    """The name z-lab's in-memory `DFlash2DraftModel` gives a codebook (an Embedding's `.weight`)."""
    if key.startswith("candidate_selector.") and key.endswith(CODEBOOK_MODULE_SUFFIX.removesuffix(".weight")):
        return key + ".weight"
    return key


def codebook_names(state_dict: dict, source: str) -> dict:
    """`state_dict` with each codebook under its one name; both spellings at once are an error."""
    renamed = {}
    for key, value in state_dict.items():
        name = codebook_name(key)
        if name in renamed:
            raise CheckpointError(f"{source}: both {name!r} and {name + '.weight'!r}: one codebook stored twice")
        renamed[name] = value
    return renamed
