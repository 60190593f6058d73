"""`dflash-audit data-check`: offline hidden-state datasets in the three writers' layouts, each planted fault exactly
one finding with exactly the records it was planted in, a sound dataset none, and a corrupt or hostile record one
line and exit 2.

The records are written here as the writers lay them out (vLLM's connector: safetensors `hidden_states` [T, L, H] and
`token_ids`; speculators: the same named `hs_<i>.safetensors`; SpecForge: a pickled dict of `input_ids`, `loss_mask`,
`hidden_states` [T, L*H]), their states computed by transformers on a distinct random target."""

from __future__ import annotations

import gzip
import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_audit.cli import main
from dflash_world.tokenizer import train_tokenizer
from tests.helpers import TEXTS

LAYERS = 6
CLAIM = [2, 4, LAYERS]  # vLLM ids: fc layers 1 and 3 (z-lab), then the last layer before the final norm
TEMPLATE = "dflash_world/chat_template_thinking.jinja"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from dflash_world.target_training import distinct_random_qwen3

    root = tmp_path_factory.mktemp("data-check-world")
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    model = distinct_random_qwen3(LAYERS, 64, len(tokenizer))
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root / "target", model, tokenizer


def states(model, ids: list[int]) -> dict:
    """Depth d (vLLM's numbering) -> [T, H]: 0 the embeddings, d the output of layer d - 1, N before the final
    norm; "normed" the last after it."""
    captured = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: captured.update(pre=args[0][0]))
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    handle.remove()
    found = {d: out.hidden_states[d][0] for d in range(LAYERS)}
    found[LAYERS] = captured["pre"]
    found["normed"] = out.hidden_states[LAYERS][0]
    return found


def sequences(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer(TEXTS[i] + TEXTS[i + 1])["input_ids"][:40] for i in range(count)]


def write_vllm(folder, model, tokenizer, count=4, plant=None, planted=(1, 3), name="hs_{i}.safetensors"):
    """A dataset as vLLM's connector writes it (speculators' names by default); `plant(i, ids, layers)` changes the
    records in `planted`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, ids in enumerate(sequences(tokenizer, count)):
        found = states(model, ids)
        layers = [found[d] for d in CLAIM]
        token_ids = torch.tensor(ids)
        if plant is not None and i in planted:
            layers, token_ids = plant(found, layers, token_ids)
        save_file({"hidden_states": torch.stack(layers, 1).contiguous(), "token_ids": token_ids},
                  str(folder / name.format(i=i)))
    return folder


def check(folder, target, *extra) -> tuple[int, dict]:
    out = folder.parent / f"{folder.name}-report"
    status = main(["data-check", str(folder), "--target", str(target), "--out", str(out), *extra])
    return status, json.loads((out / "report.json").read_text())


def keys(report) -> dict:
    return {f["key"]: f["records"] for f in report["findings"]}


def test_a_sound_vllm_dataset_is_clean_and_every_layer_named(world, tmp_path):
    target, model, tokenizer = world
    folder = write_vllm(tmp_path / "sound", model, tokenizer)
    status, report = check(folder, target, "--layer-ids", ",".join(map(str, CLAIM)))
    assert status == 0 and report["findings"] == [], report["findings"]
    assert report["facts"]["layout"] == "speculators" and report["facts"]["records_checked"] == 4
    assert report["records"][0]["slots"][0].startswith("the output of decoder layer 1 (")
    assert report["records"][0]["slots"][2].startswith("the output of decoder layer 5 (the last) before the final norm")
    (tmp_path / "sound-report" / "index.html").read_text().index("data-check")


FAULTS = {
    "zero_states": lambda found, layers, ids: ([layers[0], torch.zeros_like(layers[1]), layers[2]], ids),
    "layer_off_by_one": lambda found, layers, ids: ([found[d + 1] for d in CLAIM[:2]] + [layers[2]], ids),
    "last_layer_stripped": lambda found, layers, ids: (layers[:2], ids),
    "short_record": lambda found, layers, ids: ([t[: len(ids) - 8] for t in layers], ids),
    "after_final_norm": lambda found, layers, ids: ([layers[0], layers[1], found["normed"]], ids),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_planted_fault_is_one_finding_with_exactly_its_records(world, tmp_path, fault):
    target, model, tokenizer = world
    folder = write_vllm(tmp_path / fault, model, tokenizer, plant=FAULTS[fault])
    status, report = check(folder, target, "--layer-ids", ",".join(map(str, CLAIM)))
    assert status == 1
    assert keys(report) == {fault: ["hs_1.safetensors", "hs_3.safetensors"]}, report["findings"]


def test_a_uniform_shift_under_a_stated_claim_names_the_ids(world, tmp_path):
    """Every layer one below the claim (the capture offset of Atlas #394): one finding naming claimed and stored."""
    target, model, tokenizer = world
    folder = write_vllm(tmp_path / "shift", model, tokenizer, plant=lambda found, layers, ids: (
        [found[d - 1] for d in CLAIM], ids), planted=range(4))
    status, report = check(folder, target, "--layer-ids", ",".join(map(str, CLAIM)))
    (finding,) = report["findings"]
    assert status == 1 and finding["key"] == "layer_off_by_one"
    assert "ids [2, 4, 6] claimed, ids [1, 3, 5] stored" in finding["message"]
    assert "every one of the 4 records" in finding["message"]


def test_the_drafter_is_the_claim(world, tmp_path):
    """--drafter: the drafter's z-lab ids [1, 3] are speculators' [2, 4], then the last layer its loader strips."""
    from drafter_files.checkpoint import save_checkpoint
    from impl.model import DFlashDrafter
    from tests.helpers import tiny_spec

    target, model, tokenizer = world
    spec = tiny_spec(target_layer_ids=(1, 3), num_target_layers=LAYERS, target_vocab_size=len(tokenizer),
                     mask_token_id=1)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "drafter.pt", DFlashDrafter(spec))
    folder = write_vllm(tmp_path / "by-drafter", model, tokenizer)
    status, report = check(folder, target, "--drafter", str(tmp_path / "drafter.pt"))
    assert status == 0 and report["facts"]["claim"]["ids"] == CLAIM, report


def test_unknown_claims_stay_unknown(world, tmp_path):
    target, model, tokenizer = world
    folder = write_vllm(tmp_path / "unclaimed", model, tokenizer, plant=FAULTS["layer_off_by_one"])
    status, report = check(folder, target)
    assert status == 0 and report["findings"] == []
    assert any("unknown" in note for note in report["notes"])
    assert report["records"][1]["slots"][0].startswith("the output of decoder layer 2 (")


def specforge_record(found, ids, mask, depths=(2, 4)) -> dict:
    return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask),
            "hidden_states": torch.cat([found[d] for d in depths], -1)[None].clone()}


def chat_ids(tokenizer, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """A ChatML record (the template of `TEMPLATE`) and the mask of its assistant turns' tokens."""
    ids, mask = [], []
    for role, text in turns:
        head = tokenizer(f"<|im_start|>{role}\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(f"{text}<|im_end|>\n", add_special_tokens=False)["input_ids"]
        ids += head + body
        mask += [0] * len(head) + [int(role == "assistant")] * len(body)
    return ids, mask


def test_specforge_records_loss_mask_and_assistant_turns(world, tmp_path):
    target, model, tokenizer = world
    folder = tmp_path / "specforge"
    folder.mkdir()
    conversation = [("user", "def add(x, y):"), ("assistant", "    return x + y")]
    for i in range(3):
        ids, mask = chat_ids(tokenizer, conversation)
        if i == 2:  # the prompt supervised too
            mask = [1] * len(ids)
        torch.save(specforge_record(states(model, ids), ids, mask), folder / f"data_{i}.ckpt")
    with gzip.open(folder / "data_3.ckpt.gz", "wb") as handle:
        buffer = io.BytesIO()
        ids, mask = chat_ids(tokenizer, conversation)
        torch.save(specforge_record(states(model, ids), ids, mask), buffer)
        handle.write(buffer.getvalue())
    status, report = check(folder, target, "--layer-ids", "1,3", "--chat-template", TEMPLATE)
    assert status == 1 and keys(report) == {"loss_mask_outside_turns": ["data_2.ckpt"]}, report["findings"]
    assert report["facts"]["layout"] == "specforge"
    assert report["records"][0]["loss_mask"]["assistant_turns"] == 1
    assert report["records"][0]["slots"][1].startswith("the output of decoder layer 3 (")


class Payload:
    def __reduce__(self):
        import os

        return (os.system, ("echo never",))


def test_hostile_and_corrupt_records_are_one_line_and_exit_2(world, tmp_path, capsys):
    target, model, tokenizer = world
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name, write in (("x.ckpt", lambda p: p.write_bytes(pickle.dumps({"input_ids": Payload()}))),
                        ("y.ckpt", lambda p: torch.save({"input_ids": Payload()}, p))):
        (hostile / name).unlink(missing_ok=True)
        for other in hostile.iterdir():
            other.unlink()
        write(hostile / name)
        assert main(["data-check", str(hostile), "--target", str(target), "--out", str(tmp_path / "r1")]) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line and "weights_only=True" in line and name in line, line
    assert "posix.system" in line  # torch's own refusal of the payload's global, named
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "hs_0.safetensors").write_bytes(b"\xff" * 16)
    assert main(["data-check", str(corrupt), "--target", str(target), "--out", str(tmp_path / "r2")]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["data-check", str(empty), "--target", str(target), "--out", str(tmp_path / "r3")]) == 2
    out = ["--out", str(tmp_path / "r4")]
    assert main(["data-check", str(corrupt), "--target", str(target), "--layer-ids", "2,x", *out]) == 2
    assert main(["data-check", str(corrupt), "--target", str(target), "--records", "0", *out]) == 2
    err = capsys.readouterr().err
    assert "--layer-ids: '2,x'" in err and "--records: must be" in err


def test_speculators_layout_reads_its_table_and_holds_the_files_to_it(world, tmp_path):
    """speculators' output folder: the `datasets` table (input_ids, loss_mask per row) with hidden_states/ inside;
    a file whose token ids are not its row's is the sample speculators' loader drops."""
    from datasets import Dataset

    target, model, tokenizer = world
    folder = tmp_path / "speculators"
    write_vllm(folder / "hidden_states", model, tokenizer, count=3)
    rows = sequences(tokenizer, 3)
    table = {"input_ids": [ids if i != 2 else ids[::-1] for i, ids in enumerate(rows)],
             "loss_mask": [[0] * 8 + [1] * (len(ids) - 8) for ids in rows], "seq_len": [len(ids) for ids in rows]}
    Dataset.from_dict(table).save_to_disk(str(tmp_path / "table"))
    for entry in (tmp_path / "table").iterdir():
        entry.rename(folder / entry.name)
    status, report = check(folder, target, "--layer-ids", ",".join(map(str, CLAIM)))
    assert status == 1 and keys(report) == {"token_ids_mismatch": ["hs_2.safetensors"]}, report["findings"]
    assert report["facts"]["layout"] == "speculators"
    assert report["records"][0]["loss_mask"]["supervised"] == len(rows[0]) - 8


CORPUS_WRITER = Path(__file__).resolve().parent / "hidden_state_corpus" / "speculators_hs_writer.py"
# The independent writer's faults (tests/hidden_state_corpus/), each with the one finding it must give and the records.
CORPUS_FAULTS = {None: {}, "zero_states": {"zero_states": "all"}, "layer_off_by_one": {"layer_off_by_one": "all"},
                 "last_layer_stripped": {"last_layer_stripped": "all"}, "short_record": {"short_record": [1]},
                 "after_norm": {"after_final_norm": "all"}}


@pytest.mark.parametrize("fault", list(CORPUS_FAULTS), ids=lambda f: f or "sound")
def test_exact_on_the_independent_writer(world, tmp_path, fault):
    """A dataset written by tests/hidden_state_corpus/speculators_hs_writer.py (another hand, its own capture by
    forward hooks), sound or with one fault: data-check gives exactly the fault's one finding, on exactly its records."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("speculators_hs_writer", CORPUS_WRITER)
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    target, _, _ = world
    folder = tmp_path / "corpus"
    writer.main(["--target", str(target), "--out", str(folder), "--records", "4", "--layer-ids",
                 ",".join(map(str, CLAIM)), *(["--fault", fault] if fault else [])])
    status, report = check(folder, target, "--layer-ids", ",".join(map(str, CLAIM)))
    every = [f"hs_{i}.safetensors" for i in range(4)]
    expected = {key: every if records == "all" else [f"hs_{i}.safetensors" for i in records]
                for key, records in CORPUS_FAULTS[fault].items()}
    assert keys(report) == expected, report["findings"]
    assert status == (1 if fault else 0)


SPECFORGE_WRITER = CORPUS_WRITER.with_name("specforge_ckpt_writer.py")


@pytest.mark.parametrize("fault", list(CORPUS_FAULTS), ids=lambda f: f or "sound")
def test_exact_on_the_independent_specforge_writer(world, tmp_path, fault):
    """SpecForge's layout by tests/hidden_state_corpus/specforge_ckpt_writer.py (float16 records of z-lab ids 1, 3):
    the fault's one finding on its records, beside the warning that float16 is not the float32 target's dtype."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specforge_ckpt_writer", SPECFORGE_WRITER)
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    target, _, _ = world
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [1, 3]}}))
    folder = tmp_path / "corpus"
    writer.main(["--target", str(target), "--out", str(folder), "--records", "4", "--draft-config",
                 str(tmp_path / "draft" / "config.json"), *(["--fault", fault] if fault else [])])
    status, report = check(folder, target, "--layer-ids", "1,3")
    every = [f"data_{i}.ckpt" for i in range(4)]
    expected = {key: every if records == "all" else [f"data_{i}.ckpt" for i in records]
                for key, records in CORPUS_FAULTS[fault].items()}
    assert keys(report) == {**expected, "dtype": every}, report["findings"]
    assert status == (1 if fault else 0)
