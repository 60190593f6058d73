"""A reduced draft vocabulary (PITFALLS #32): the mapping as speculators builds it, the three formats and
`convert`, decoding through the map (live = offline), `train --draft-vocab-size`, and the audit of a drafter
written by speculators' own code against its z-lab twin."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from dflash_audit.conversion import convert
from drafter_files.checkpoint import load_checkpoint, save_checkpoint
from impl.model import DFlashDrafter
from impl.spec import DraftSpec, SpecError
from impl.vocab_mapping import (
    count_token_frequencies,
    d2t_from_target_ids,
    mapping_from_frequencies,
    t2d_from_d2t,
    target_ids,
)
from tests.helpers import tiny_spec, tiny_target

DRAFT_VOCAB = 48  # of the tiny target's 128 / the world target's 2048 (then 512)


def divergent(result) -> list[tuple[str, str]]:
    return [(f.component, f.key) for f in result.findings if f.severity in ("divergence", "warning")]


def rows_with_counts(seed: int = 0):
    """(input_ids, loss_mask) rows with ties and ids the mask hides."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 90, (40,), generator=gen), (torch.rand(40, generator=gen) > 0.3).long())
            for _ in range(3)]


# -- the mapping, against speculators' own builder ---------------------------------------------------------------
@pytest.mark.parametrize("draft_vocab_size", [16, 100])  # fewer than the distinct tokens; more (padded)
def test_mapping_from_token_frequencies_is_speculators_mapping(tmp_path, draft_vocab_size):
    from datasets import Dataset
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    rows = rows_with_counts()
    dataset = Dataset.from_dict({"input_ids": [r[0].tolist() for r in rows],
                                 "loss_mask": [r[1].tolist() for r in rows]}).with_format("torch")
    save_token_frequency_distribution(dataset, tmp_path / "freq.pt")
    theirs_freq = torch.load(tmp_path / "freq.pt", weights_only=True)
    ours_freq = count_token_frequencies(rows)
    assert ours_freq == theirs_freq
    d2t_ref, t2d_ref = build_vocab_mappings_from_distribution(theirs_freq, draft_vocab_size, 128)
    d2t = mapping_from_frequencies(ours_freq, draft_vocab_size, 128)
    assert torch.equal(d2t, d2t_ref) and torch.equal(t2d_from_d2t(d2t, 128), t2d_ref)


def test_spec_keeps_the_target_vocabulary_and_refuses_bad_sizes():
    spec = tiny_spec(draft_vocab_size=DRAFT_VOCAB)
    assert spec.target_vocab_size == 128 and spec.head_size == DRAFT_VOCAB and spec.reduced_vocab
    assert tiny_spec(draft_vocab_size=128).draft_vocab_size is None  # equal sizes: no reduced vocabulary
    with pytest.raises(SpecError, match="draft_vocab_size"):
        tiny_spec(draft_vocab_size=129)
    with pytest.raises(SpecError, match="draft_vocab_size"):
        tiny_spec(draft_vocab_size=16, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    assert DraftSpec.from_dict({k: v for k, v in spec.to_dict().items() if k != "draft_vocab_size"}).draft_vocab_size \
        is None  # a checkpoint written before the field reads as before


def reduced_drafter(spec_overrides=None, seed: int = 0, ids=None) -> tuple[DFlashDrafter, torch.nn.Module]:
    target = tiny_target()
    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_spec(draft_vocab_size=DRAFT_VOCAB, **(spec_overrides or {})))
    ids = ids if ids is not None else sorted(torch.randperm(128, generator=torch.Generator().manual_seed(seed))
                                             [:DRAFT_VOCAB].tolist())
    drafter.set_vocab_mapping(d2t_from_target_ids(ids), target.lm_head)
    return drafter, target


def test_logits_land_on_the_mapped_target_ids():
    drafter, target = reduced_drafter()
    hidden = torch.randn(5, 64)
    draft = drafter.draft_logits(hidden, target.lm_head)
    full = drafter.compute_logits(hidden, target.lm_head)
    ids = target_ids(drafter.d2t)
    assert draft.shape == (5, DRAFT_VOCAB) and full.shape == (5, 128)
    assert torch.equal(full[:, ids], draft) and torch.isinf(full).sum() == 5 * (128 - DRAFT_VOCAB)
    assert torch.equal(full.argmax(-1), ids[draft.argmax(-1)])  # draft id k proposes target id k + d2t[k]
    torch.testing.assert_close(draft, hidden @ target.lm_head.weight[ids].T)  # the head is the target's rows


# -- formats and convert ----------------------------------------------------------------------------------------
def test_convert_is_exact_both_ways_and_zlab_carries_d2t_as_vllm_reads_it(tmp_path, target_dir):
    drafter, _ = reduced_drafter({"num_target_layers": 6, "target_layer_ids": (1, 3, 4)})
    save_checkpoint(tmp_path / "a.pt", drafter)
    convert(tmp_path / "a.pt", tmp_path / "spec", "speculators", target=target_dir)
    convert(tmp_path / "spec", tmp_path / "b.pt", "ours", target=target_dir)
    convert(tmp_path / "b.pt", tmp_path / "zlab", "zlab")
    convert(tmp_path / "zlab", tmp_path / "c.pt", "ours")
    original = load_checkpoint(tmp_path / "a.pt")
    for name in ("b.pt", "c.pt"):
        back = load_checkpoint(tmp_path / name)
        assert back.spec == original.spec
        assert set(back.state_dict) == set(original.state_dict)
        for key, tensor in original.state_dict.items():
            assert torch.equal(back.state_dict[key], tensor) and back.state_dict[key].dtype == tensor.dtype, key
    spec_tensors = load_file(tmp_path / "spec" / "model.safetensors")
    assert torch.equal(spec_tensors["d2t"], drafter.d2t) and torch.equal(spec_tensors["t2d"], t2d_from_d2t(drafter.d2t, 128))
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB
    zlab_tensors = load_file(tmp_path / "zlab" / "model.safetensors")
    assert torch.equal(zlab_tensors["d2t"], drafter.d2t) and zlab_tensors["lm_head.weight"].shape == (DRAFT_VOCAB, 64)
    assert json.loads((tmp_path / "zlab" / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB
    result = static_audit(load_side(tmp_path / "spec", target_dir), load_side(tmp_path / "zlab"),
                          expect_identical=True)
    assert divergent(result) == []


# -- the audit: a drafter written by speculators' own code against its z-lab twin --------------------------------
def speculators_written(world, path, draft_vocab_size: int = 512):
    """The world's trained drafter, reduced to its data's most frequent tokens and written by speculators:
    `DFlashDraftModel` + `load_vocab_mappings` + `load_verifier_weights` (its head = the verifier's t2d rows)
    + `save_pretrained`. Returns the d2t."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoTokenizer

    from dflash_audit.prompts import load_prompts
    from dflash_world.drafter import cached_test_drafter
    from reference_adapters.speculators_adapter import on_cpu_attention, speculators_config

    ckpt = load_checkpoint(cached_test_drafter(world))
    spec = ckpt.spec.replace(draft_vocab_size=draft_vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(world.target)
    texts = [record["prompt"] for record in load_prompts(world.prompts)]
    ids = torch.tensor(tokenizer("\n".join(texts))["input_ids"])
    freq = count_token_frequencies([(ids, torch.ones_like(ids))])
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, spec.target_vocab_size)
    model = DFlashDraftModel(on_cpu_attention(speculators_config(spec, world.target)))
    model.load_state_dict(ckpt.state_dict, strict=False)
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    model.save_pretrained(str(path))
    return d2t


@pytest.fixture(scope="module")
def written(test_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-vocab")
    d2t = speculators_written(test_world, root / "spec")
    convert(root / "spec", root / "zlab", "zlab", target=test_world.target)
    return root, d2t


def test_speculators_written_reduced_drafter_and_its_zlab_twin_have_no_finding_and_equal_tau(test_world, written,
                                                                                                 tmp_path):
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.flags.compare import CompareFlags

    root, d2t = written
    assert set(load_file(root / "spec" / "model.safetensors")) >= {"d2t", "t2d", "lm_head.weight"}
    report = run_compare(CompareFlags(ours=root / "spec", ref=root / "zlab", target=test_world.target,
                                      prompts=test_world.prompts, out=tmp_path / "out", max_new_tokens=24, budget=8,
                                      cache_dir=root))
    assert [(f.component, f.key) for f in report.findings if f.severity != "info"] == []
    assert not [f for f in report.findings if f.component == "draft_vocab"]
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert all(p["ours_rounds"] == p["ref_rounds"] for p in data["tau"]["prompts"])
    assert data["tau"]["mean"]["ours"] > 1.5  # the reduced head still drafts what the target accepts
    share = data["tau"]["draft_vocab_share"]
    assert share["ours"] == share["ref"] and 0 < share["ours"]["share"] < 1  # the same 512 of 2048 tokens


def test_twin_with_another_mapping_is_one_draft_vocab_finding_naming_the_ids(written, test_world, tmp_path):
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.flags.compare import CompareFlags

    root, d2t = written
    tensors = load_file(root / "zlab" / "model.safetensors")
    ids = target_ids(d2t).tolist()
    unused = [i for i in range(2048) if i not in set(ids)][:3]
    moved = sorted(ids[:-3] + unused)  # three target ids swapped for three others
    tensors["d2t"] = d2t_from_target_ids(moved)
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "config.json").write_text((root / "zlab" / "config.json").read_text())
    save_file(tensors, str(tmp_path / "twin" / "model.safetensors"))
    result = static_audit(load_side(root / "spec", test_world.target), load_side(tmp_path / "twin"))
    assert divergent(result) == [("draft_vocab", "mapping")]
    finding = result.findings[[f.key for f in result.findings].index("mapping")]
    assert "3 target id(s)" in finding.message and finding.ours == {"only_ours": 3}
    assert next(r for r in result.tensor_rows if r.key == "d2t").explained_by == "draft_vocab"
    # compare with τ: still that one finding, now with the share of the target's tokens each side can propose
    report = run_compare(CompareFlags(ours=root / "spec", ref=tmp_path / "twin", target=test_world.target,
                                      prompts=test_world.prompts, out=tmp_path / "out", max_new_tokens=24, budget=8,
                                      cache_dir=root))
    vocab = [f for f in report.findings if f.component == "draft_vocab"]
    assert [(f.key, f.severity) for f in vocab] == [("mapping", "divergence")]
    assert set(vocab[0].raw["proposable_share"]) == {"ours", "ref"} and "generated tokens" in vocab[0].message
    assert [f.component for f in report.findings if f.severity != "info" and f.component != "tau"] == ["draft_vocab"]


@pytest.mark.parametrize("strip_config", [False, True])
def test_reduced_drafter_with_its_mapping_stripped_is_one_divergence(written, test_world, tmp_path, strip_config,
                                                                      capsys):
    root, _ = written
    tensors = {k: v for k, v in load_file(root / "zlab" / "model.safetensors").items() if k != "d2t"}
    config = json.loads((root / "zlab" / "config.json").read_text())
    if strip_config:
        config.pop("draft_vocab_size")
    (tmp_path / "stripped").mkdir()
    (tmp_path / "stripped" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "stripped" / "model.safetensors"))
    result = static_audit(load_side(tmp_path / "stripped"), load_side(root / "zlab"))
    assert divergent(result) == [("draft_vocab", "mapping of ours")]
    assert "no d2t mapping" in result.findings[0].message
    # eval refuses it in one line, for the reason compare leaves its τ unmeasured (dflash_audit/audit/drafter_fit.py)
    code = main(["eval", "--drafter", str(tmp_path / "stripped"), "--target", str(test_world.target),
                 "--prompts", str(test_world.prompts), "--max-new-tokens", "8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "reduced head of 512 tokens has no usable draft-to-target map (no d2t mapping)" in err
    if strip_config:  # compare with τ: still the one divergence; the stripped side is not run as something else
        from dflash_audit.audit.compare import run_compare
        from dflash_audit.flags.compare import CompareFlags

        report = run_compare(CompareFlags(ours=tmp_path / "stripped", ref=root / "zlab", target=test_world.target,
                                          prompts=test_world.prompts, out=tmp_path / "out", max_new_tokens=24,
                                          budget=8, cache_dir=root))
        assert [(f.component, f.key) for f in report.divergences] == [("draft_vocab", "mapping of ours")]
        assert any(f.key == "not measured (ours)" and "draft-to-target map" in f.message for f in report.findings)
        assert report.dynamic.not_measured["ours"] in err


def test_live_equals_offline_through_the_mapping(written, trained_pair, test_world, tmp_path):
    from impl.body_shapes import build_drafter
    from impl.ddtree import ddtree_decode
    from impl.decoding import dflash_decode
    from impl.offline import find_mismatch, load_or_build_cache, offline_rounds

    root, _ = written
    _, target, prompts, stop_ids = trained_pair
    side = load_side(root / "zlab")
    drafter = build_drafter(side.spec, side.state_dict).float().eval()
    prompts = prompts[:3]
    cache = load_or_build_cache(tmp_path, test_world.target, target, prompts, 24, stop_ids)
    for entry, (_, ids) in zip(cache.prompts, prompts):
        live = dflash_decode(drafter, target, ids, 24, stop_ids)
        assert find_mismatch(entry, offline_rounds(drafter, target, cache, entry), live.acceptance_lengths,
                             live.output_ids) is None
        tree = ddtree_decode(drafter, target, ids, 24, stop_ids, budget=8)
        assert find_mismatch(entry, offline_rounds(drafter, target, cache, entry, "ddtree", budget=8),
                             tree.acceptance_lengths, tree.output_ids) is None


# -- train --draft-vocab-size ------------------------------------------------------------------------------------
def test_train_with_a_reduced_vocabulary_and_with_a_d2t_file(tiny_world, tmp_path):
    from foundation.target import load_target_model, load_tokenizer
    from impl.run_settings import RunSettings
    from impl.train import load_data

    target, data = tiny_world / "target", tiny_world / "data.jsonl"
    common = ["train", "--target", str(target), "--data", str(data), "--steps", "2", "--seq-len", "64",
              "--batch-size", "2", "--block-size", "4", "--max-anchors", "4", "--eval-sequences", "1"]
    assert main([*common, "--out", str(tmp_path / "a.pt"), "--draft-vocab-size", "40"]) == 0
    ckpt = load_checkpoint(tmp_path / "a.pt")
    tokenizer, config = load_tokenizer(str(target))
    train_rows, _ = load_data(RunSettings(target=str(target), out="", data=str(data), seq_len=64, eval_sequences=1),
                              tokenizer, config.vocab_size)
    expected = mapping_from_frequencies(count_token_frequencies(zip(train_rows.input_ids, train_rows.loss_mask)), 40,
                                        config.vocab_size)
    assert ckpt.spec.draft_vocab_size == 40 and torch.equal(ckpt.state_dict["d2t"], expected)
    head = load_target_model(str(target)).lm_head.weight
    assert torch.equal(ckpt.state_dict["lm_head.weight"], head[target_ids(expected)])  # frozen target rows
    np.save(tmp_path / "d2t.npy", d2t_from_target_ids(list(range(5, 45))).numpy())
    assert main([*common, "--out", str(tmp_path / "b.pt"), "--d2t", str(tmp_path / "d2t.npy")]) == 0
    assert torch.equal(target_ids(load_checkpoint(tmp_path / "b.pt").state_dict["d2t"]), torch.arange(5, 45))


@pytest.mark.parametrize("args, message", [
    (["--draft-vocab-size", "0"], "--draft-vocab-size: must be a positive"),
    (["--draft-vocab-size", "100000"], "--draft-vocab-size 100000: larger than the target's vocabulary of"),
    (["--d2t", "{tmp}/missing.npy"], "--d2t"),
    (["--d2t", "{tmp}/bad.npy"], "--d2t"),
    (["--d2t", "{tmp}/outside.npy"], "outside the target vocabulary"),
])
def test_train_refuses_bad_draft_vocabularies_in_one_line(tiny_world, tmp_path, capsys, args, message):
    np.save(tmp_path / "bad.npy", np.zeros((2, 2), dtype=np.float32))
    np.save(tmp_path / "outside.npy", np.array([0, 100000], dtype=np.int64))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = main(["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
                 "--out", str(tmp_path / "x.pt"), "--steps", "1", "--seq-len", "64", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_vllm_serves_the_map_only_when_d2t_is_shipped(written, test_world, tmp_path):
    """serve-check: vLLM reads `draft_vocab_size` and `d2t` from a z-lab directory; without `d2t` its zero offsets
    read draft id k as target id k, one `draft_to_target` divergence (#32)."""
    from serving_engines import TargetFacts
    from serving_engines.verdict import engine_report

    root, _ = written
    spec = load_side(root / "zlab").spec
    facts = TargetFacts.read(test_world.target)
    shipped = engine_report("vllm", str(root / "zlab"), spec, facts)
    assert shipped.served["draft_to_target"] == "d2t" == shipped.trained["draft_to_target"]
    # The drafter reads the target's last layer, which vLLM captures before the final norm (its forward's, no file's).
    assert [f.field for f in shipped.findings if f.severity == "divergence"] == ["target_layer_capture"]
    (tmp_path / "stripped").mkdir()
    (tmp_path / "stripped" / "config.json").write_text((root / "zlab" / "config.json").read_text())
    save_file({k: v for k, v in load_file(root / "zlab" / "model.safetensors").items() if k != "d2t"},
              str(tmp_path / "stripped" / "model.safetensors"))
    stripped = engine_report("vllm", str(tmp_path / "stripped"), spec, facts)
    assert [(f.field, f.severity, f.pitfall) for f in stripped.findings] == [("draft_to_target", "divergence", 32),
                                                                            ("target_layer_capture", "divergence", 26),
                                                                            ("draft_sampling", "info", None)]
