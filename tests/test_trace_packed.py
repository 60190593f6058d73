"""A trainer on offline hidden states, its records packed into one row by speculators' own `CollateFn`, the rows past
the records zero padding (tests/trace_scripts/packed_offline_step.py; the target never runs in it, `--target` names
it): the context features are named on the records' rows only. Clean states give no noise finding; noise added to
the records' states by the collate's `preprocess` hook is the one info finding, with its std."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_audit.trace.step_audit.audit import audit_recording
from dflash_audit.trace.record.recording import read_recording
from dflash_audit.trace.record.launch import record_script
from dflash_world.target_training import distinct_random_qwen3

SCRIPT = Path(__file__).resolve().parent / "trace_scripts" / "packed_offline_step.py"
AUX = [2, 6, 10]  # speculators' ids (hidden_states indices), z-lab's 1, 5, 9
LENGTHS = (30, 24, 20)  # 74 positions of records in a packed row of 96: 22 rows of padding
SEQ_LEN = 96


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, Path]:
    """The target's folder and the records its states were written to (here, in the test: the traced script never
    runs the target)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("packed")
    target = distinct_random_qwen3(12, 64, 512)
    target.save_pretrained(folder / "target")
    raw = {}
    target.model.norm.register_forward_pre_hook(lambda m, a: raw.update(last=a[0]))
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    with torch.no_grad():
        for i, n in enumerate(LENGTHS):
            ids = torch.randint(1, 511, (1, n), generator=generator)
            states = target(input_ids=ids, output_hidden_states=True).hidden_states
            tensors[f"r{i}.input_ids"] = ids[0]
            tensors[f"r{i}.hidden_states"] = torch.cat([states[a] for a in AUX], -1)[0].contiguous()
            tensors[f"r{i}.verifier_last_hidden_states"] = raw["last"][0].contiguous()
    save_file(tensors, folder / "records.safetensors")
    return folder / "target", folder / "records.safetensors"


def trace(world, out: Path, *extra: str):
    target, records = world
    record_script(SCRIPT, ["--target", str(target), "--data", str(records), "--seq-len", str(SEQ_LEN), *extra], out,
                  target=target)
    return audit_recording(read_recording(out))


def context_row(report):
    (row,) = [r for r in report.tensors if r.role == "drafter_input" and "context features" in r.what]
    return row


def test_padding_of_a_packed_row_is_no_noise(world, tmp_path):
    report = trace(world, tmp_path)
    assert [(f.component, f.key) for f in report.findings if f.component == "noise"] == [], \
        [f.message for f in report.findings]
    row = context_row(report)
    assert row.shape == [1, SEQ_LEN, 3 * 64] and "22 rows of padding" in row.what and "all zero" in row.what, row.what
    assert report.flow["fc_layers"] == [1, 5, 9]


def test_noise_on_the_same_packed_layout_is_found_with_its_std(world, tmp_path):
    report = trace(world, tmp_path, "--input-noise", "0.05")
    noise = [f for f in report.findings if f.component == "noise"]
    assert [(f.key, f.severity) for f in noise] == [("inputs", "info")], [f.message for f in report.findings]
    assert noise[0].ours == pytest.approx(0.05, rel=0.05)
