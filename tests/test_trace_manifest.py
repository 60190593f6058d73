"""The recording's manifest as one model (dflash_audit/trace/record/manifest.py): what the writer builds through it
the reader hands the audit back unchanged (keys, values, order, the keys the model does not declare); what it
refuses is one line on either side."""

from __future__ import annotations

import json

import pytest

from dflash_audit.trace.record.manifest import Manifest, ManifestRefused, manifest_text
from dflash_audit.trace.record.recording import TENSORS, check_manifest
from foundation.errors import AuditError


def recorded_manifest() -> dict:
    """A manifest as write_recording assembles it (one step, one micro-batch-free entry of each kind it names)."""
    step = {"step": 1, "loss": 2.5,
            "entries": {"tokens.0": {"role": "tokens", "shape": [1, 8], "dtype": "int64", "device": "cpu"},
                        "fed.1": {"role": "drafter_input", "shape": [1, 8, 64], "dtype": "float32", "device": "cpu",
                                  "module": "fc", "module_class": "Linear", "call": 1}},
            "graph": [{"index": 0, "name": "MeanBackward0", "next": []}], "graph_nodes": 3,
            "drafter": {"class": "model:Drafter", "placement": ["cpu"],
                        "facts": {"block_size": 4, "target_layer_ids": [1, 2], "sample_from_anchor": True},
                        "trainable_in_loss": 12},
            "target": {"path": "/models/target", "class": "Qwen3ForCausalLM", "placement": ["cpu"],
                       "facts": {"hidden_size": 64}, "dtype": "float32", "layers_placement": [["cpu"], ["cpu"]]},
            "micro_batches": 1}
    return {"schema": "dflash-audit/trace-recording/1", "format": 1, "tensors_file": "recording.safetensors",
            "tensors_bytes": 4096, "tensors_sha256": "0" * 64, "tensor_payload_bytes": 2112,
            "versions": {"torch": "2.13.0", "transformers": "5.0.0"},
            "context": {"rank": 0, "world_size": 1, "argv": ["train.py"], "steps_requested": 1,
                        "compile_disabled": False, "run": {"structure": None, "steps": [{"lrs": [[0.001]]}]}},
            "steps": [step]}


def test_the_reader_hands_back_what_the_writer_built():
    manifest = recorded_manifest()
    text = manifest_text(manifest)
    assert text == json.dumps(manifest, indent=1) + "\n"  # the file as before: same keys, values, order
    read = check_manifest(json.loads(text), "--from rec: manifest.json")
    assert json.dumps(read) == json.dumps(manifest)
    assert Manifest.model_fields["tensors_file"].default == TENSORS  # the name the reader falls back on


@pytest.mark.parametrize("edit, place", [
    (lambda m: m["steps"][0]["drafter"]["facts"].update(block_size="four"), "steps.0.drafter.facts.block_size"),
    (lambda m: m["steps"][0]["entries"]["tokens.0"].update(shape="1x8"), "steps.0.entries.tokens.0.shape"),
    (lambda m: m["steps"][0].pop("target"), "steps.0.target"),
])
def test_what_the_model_refuses_is_one_line_on_either_side(edit, place):
    manifest = recorded_manifest()
    edit(manifest)
    with pytest.raises(ManifestRefused) as written:
        manifest_text(manifest)
    with pytest.raises(AuditError) as read:
        check_manifest(manifest, "--from rec: manifest.json")
    for message in (str(written.value), str(read.value)):
        assert "\n" not in message and f": {place}: " in message, message
    assert str(read.value).startswith("--from rec: manifest.json: ") and "record it again" in str(read.value)
