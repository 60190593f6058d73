"""The trainer: data packing, the shared training step, knobs, resume, CLI errors, and learning."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_audit.cli import main
from drafter_files.checkpoint import load_checkpoint
from impl.data import DataError, Document, load_packed, pack_documents, pack_records
from impl.model import DFlashDrafter
from impl.recipe import Recipe
from impl.train import TrainError, lr_factor, train_drafter
from impl.train_step import training_step
from tests.helpers import TEXTS, tiny_spec, tiny_target

TINY_RUN = dict(seq_len=48, block_size=4, max_anchors=6, target_layer_ids=[0, 1, 2], batch_size=2, lr=3e-3, warmup=2,
                eval_sequences=2, progress=False)


# -- data ----------------------------------------------------------------------------------
def test_packing_numbers_documents_restarts_positions_and_pads():
    docs = [Document([5, 6, 7], [1, 1, 1]), Document([8, 9, 10, 11, 12], [0, 1, 1, 1, 1])]
    packed = pack_documents(docs, seq_len=6, pad_id=0, digest="h")
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 0, 0, 0, 0]]
    assert packed.document_ids.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, -1, -1, -1, -1]]
    assert packed.loss_mask.tolist() == [[1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2]
    assert packed.position_ids[1, :2].tolist() == [0, 1]


def test_data_hash_is_stable_and_covers_seq_len(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n')
    first = load_packed(path, None, 10, 8, 0).data_hash
    assert first == load_packed(path, None, 10, 8, 0).data_hash
    assert first != load_packed(path, None, 10, 16, 0).data_hash
    assert first != load_packed(path, None, 11, 8, 0).data_hash


@pytest.mark.parametrize("line, message", [
    ("{not json", "d.jsonl:2: invalid JSON"),
    ('{"input_ids": [1, 99]}', "d.jsonl:2: token id 99 outside the vocabulary of 10"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', "d.jsonl:2: loss_mask has 1 entries for 2 input_ids"),
    ('{"prompt": "x"}', "d.jsonl:2: expected one of the keys"),
    ('{"text": "x"}', "d.jsonl:2: 'text' needs the target's tokenizer"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(DataError, match=message.replace("[", r"\[")):
        load_packed(path, None, 10, 8, 0)


# Characters JSON allows raw inside a string but str.splitlines() cuts at (the ASCII ones it
# also cuts at, \x0b \x0c \x1c-\x1e, are control characters JSON requires escaped).
LINE_BREAKS_INSIDE_JSON = ["\u2028", "\u2029", "\x85"]


@pytest.mark.parametrize("char", LINE_BREAKS_INSIDE_JSON)
def test_a_raw_unicode_line_separator_inside_a_string_is_one_record(tiny_world, tmp_path, char):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_world / "target")
    path = tmp_path / "d.jsonl"
    text = f"def add(x, y):{char}    return x + y"
    path.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n" + '{"input_ids": [1, 2]}\n', encoding="utf-8")
    assert char in path.read_text(encoding="utf-8")  # written raw, not escaped
    packed = load_packed(path, tokenizer, len(tokenizer), 64, 0)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id, 1, 2]
    assert packed.input_ids[0][: len(expected)].tolist() == expected


def test_chat_messages_train_assistant_turns_only(tiny_world):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_world / "target")
    with pytest.raises(DataError, match="chat template"):
        pack_records([{"messages": [{"role": "user", "content": "x"}]}], tokenizer, len(tokenizer), 64, 0)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "def add_1(x, y):"}, {"role": "assistant", "content": "return total"}]
    packed = pack_records([{"messages": messages}], tokenizer, len(tokenizer), 64, 0)
    trained = packed.input_ids[0][packed.loss_mask[0].bool()].tolist()
    assert tokenizer.decode(trained).strip() == "return total"


# -- the shared training step --------------------------------------------------------------
def test_noise_reaches_drafter_inputs_but_never_targets():
    spec = tiny_spec()
    target = tiny_target()
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec)
    ids = torch.randint(0, 128, (2, 40))
    loss_mask = torch.ones_like(ids)
    docs = torch.zeros_like(ids)

    def step(noise):
        generators = [torch.Generator().manual_seed(row) for row in range(2)]
        return training_step(drafter, target, ids, loss_mask, docs, Recipe(noise_std=noise, max_anchors=5),
                             generators=generators)

    clean, noisy = step(0.0), step(0.5)
    assert torch.equal(clean.outputs.anchors, noisy.outputs.anchors)
    assert torch.equal(clean.outputs.targets, noisy.outputs.targets)
    assert torch.equal(clean.clean_context, noisy.clean_context)
    assert torch.equal(clean.drafter_context, clean.clean_context)
    assert (noisy.drafter_context - noisy.clean_context).std().item() == pytest.approx(0.5, rel=0.05)
    assert not torch.allclose(clean.outputs.logits, noisy.outputs.logits)


def test_schedule_warms_up_then_decays():
    factors = [lr_factor(s, warmup=4, total=20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[-1] > 0.1 - 1e-9


# -- the trainer ---------------------------------------------------------------------------
def test_knobs_are_recorded_truthfully(tiny_world, tmp_path):
    out = tmp_path / "bug.pt"
    stats = train_drafter(tiny_world / "target", TEXTS, out, steps=2, **{**TINY_RUN, "target_layer_ids": [0, 1]},
                          verifier_source_layer=2, gamma=7.0, noise_std=0.1, loss_fn="ce")
    ckpt = load_checkpoint(out)
    assert ckpt.spec.target_layer_ids == (0, 1)
    assert ckpt.state_dict["fc.weight"].shape == (64, 2 * 64)
    assert ckpt.recipe.verifier_source_layer == 2
    assert (ckpt.recipe.gamma, ckpt.recipe.loss_fn, ckpt.recipe.noise_std) == (7.0, "ce", 0.1)
    assert ckpt.recipe.max_anchors == 6 and ckpt.recipe.data_hash.startswith("sha256:")
    assert ckpt.step == 2 and set(ckpt.training_state) >= {"optimizer", "scheduler", "rng", "history"}
    assert ckpt.spec.mask_token_id == 1  # the tokenizer's <|mask|>
    assert stats["recipe"] == ckpt.recipe.to_dict()
    # The final layer is the reference recipe: recorded as None.
    train_drafter(tiny_world / "target", TEXTS, out, steps=1, **TINY_RUN, verifier_source_layer=3)
    assert load_checkpoint(out).recipe.verifier_source_layer is None


def test_resume_continues_the_same_loss_curve(tiny_world, tmp_path):
    run = dict(**TINY_RUN, steps=6, grad_accum=2, noise_std=0.05)
    whole = train_drafter(tiny_world / "target", TEXTS, tmp_path / "whole.pt", **run)
    # Same run, interrupted after step 3, then resumed to the end.
    halves = tmp_path / "halves.pt"
    train_drafter(tiny_world / "target", TEXTS, halves, **run, stop_at=3)
    resumed = train_drafter(tiny_world / "target", TEXTS, halves, **run, resume=True)
    assert resumed["steps"] == 6 and len(resumed["losses"]) == 6
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"]), rtol=1e-5, atol=1e-7)
    a, b = load_checkpoint(tmp_path / "whole.pt"), load_checkpoint(halves)
    for key, value in a.state_dict.items():
        torch.testing.assert_close(b.state_dict[key], value, rtol=1e-5, atol=1e-6)


def test_resume_refuses_other_data(tiny_world, tmp_path):
    out = tmp_path / "r.pt"
    train_drafter(tiny_world / "target", TEXTS, out, steps=1, **TINY_RUN)
    with pytest.raises(TrainError, match="different data"):
        train_drafter(tiny_world / "target", TEXTS[:-2], out, steps=2, **TINY_RUN, resume=True)


def test_bf16_autocast_trains(tiny_world, tmp_path):
    stats = train_drafter(tiny_world / "target", TEXTS, tmp_path / "bf16.pt", steps=2, **TINY_RUN, dtype="bf16")
    assert all(torch.isfinite(torch.tensor(stats["losses"])))
    assert load_checkpoint(tmp_path / "bf16.pt").state_dict["fc.weight"].dtype == torch.float32


def test_loss_decreases_on_the_trained_test_target(test_world, tmp_path):
    from dflash_world import stdlib_corpus

    texts = stdlib_corpus("train", max_bytes=30_000)
    stats = train_drafter(test_world.target, texts, tmp_path / "d.pt", steps=15, seq_len=64, block_size=4,
                          max_anchors=8, batch_size=2, lr=3e-3, warmup=2, eval_sequences=2, progress=False,
                          loss_fn="kl_div", per_position_loss_weight="fixed-exp-decay")  # the KL run measured below
    losses = torch.tensor(stats["losses"])
    # A fresh drafter's KL to the trained target drops fast (measured: 1.34 -> ~0.65 in 15 steps).
    assert losses[-5:].mean() < 0.75 * losses[0]
    assert stats["eval"]["loss"] < losses[0]


# -- CLI -----------------------------------------------------------------------------------
def test_cli_trains_and_writes_json(tiny_world, tmp_path):
    out, report = tmp_path / "c.pt", tmp_path / "stats.json"
    code = main(["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"),
                 "--out", str(out), "--steps", "2", "--seq-len", "48", "--block-size", "4", "--max-anchors", "4",
                 "--fc-layers", "0,2", "--batch-size", "2", "--json", str(report)])
    assert code == 0
    assert load_checkpoint(out).spec.target_layer_ids == (0, 2)
    assert json.loads(report.read_text())["steps"] == 2


@pytest.mark.parametrize("args, message", [
    (["--target", "{root}/missing"], "no such directory"),
    (["--data", "{root}/missing.jsonl"], "no such file"),
    (["--data", "{root}/bad.jsonl"], "bad.jsonl:1: 'text' must be a string"),
    (["--fc-layers", "0,x"], "--target-layer-ids: '0,x' is not a list of integer layer ids"),
    (["--fc-layers", "0,9"], "--target-layer-ids: [9] outside"),
    (["--target-source-layer", "7"], "--verifier-source-layer: 7 outside"),
    (["--loss", "mse"], "--loss-fn: 'mse' is not one of ['kl_div', 'ce', 'tv'] nor a JSON dict of them to weights"),
    (["--loss-weighting", "uniform"], "--per-position-loss-weight: must be fixed-exp-decay or dpace, got 'uniform'"),
    (["--loss", "kl_div", "--loss-weighting", "dpace"], "--per-position-loss-weight: dpace needs loss_fn ce"),
    (["--dpace-alpha", "1.5"], "--dpace-alpha: must be in (0, 1], got 1.5"),
    (["--dtype", "fp16"], "--dtype: must be fp32 or bf16, got 'fp16'"),
    (["--family", "nope"], "--family: must be one of dflash, dflash2, dspark, xpress, got 'nope'"),
    (["--recipe", "zlab"], "--recipe: must be speculators, got 'zlab'"),
    (["--steps", "0"], "--steps: must be a positive integer, got 0"),
    (["--warmup", "-3"], "--warmup: must be an integer >= 0, got -3"),
    (["--lr", "inf"], "--lr: must be a finite number, got inf"),
    (["--markov-rank", "4"], "--markov-rank is a DSpark setting; add --family dspark"),
    (["--seq-len", "4"], "--seq-len: 4 leaves no room for a block of 4"),
    (["--seq-len", "100000"], "--seq-len: 100000 is longer than the target's context window"),
    (["--draft-vocab-size", "8", "--family", "dflash2"], "--draft-vocab-size: a reduced draft vocabulary needs --family "
                                                          "dflash"),
    (["--layer-types", "bogus"], "--layer-types: must be full_attention or sliding_attention, got 'bogus'"),
    # A window of 0 is refused by its declaration, whether or not a layer slides.
    (["--sliding-window", "0"], "--sliding-window: must be a positive integer, got 0"),
    (["--layer-types", "sliding_attention", "--sliding-window", "0"], "--sliding-window: must be a positive integer, "
                                                                      "got 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tiny_world, tmp_path, capsys, args, message):
    (tiny_world / "bad.jsonl").write_text('{"text": 5}\n')
    base = {"--target": str(tiny_world / "target"), "--data": str(tiny_world / "data.jsonl"),
            "--out": str(tmp_path / "x.pt"), "--steps": "1", "--seq-len": "48", "--block-size": "4",
            "--fc-layers": "0,1"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value.format(root=tiny_world)
    code = main(["train", *(part for pair in base.items() for part in pair)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "x.pt").exists()


def test_packed_rows_keep_the_target_inside_each_document():
    """Restarting position ids make transformers mask attention per document (as if run alone)."""
    from impl.extract import HiddenStateExtractor

    target = tiny_target()
    docs = [Document(list(range(3, 13)), [1] * 10), Document(list(range(20, 34)), [1] * 14)]
    packed = pack_documents(docs, seq_len=24, pad_id=0, digest="h")
    extract = HiddenStateExtractor(target, [1, 3])
    together = extract(packed.input_ids, position_ids=packed.position_ids)
    alone = extract(torch.tensor([docs[1].input_ids]))
    torch.testing.assert_close(together.context[:, 10:], alone.context, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.final_raw[:, 10:], alone.final_raw, rtol=1e-5, atol=1e-5)
