"""The target's stop ids: one reader (`foundation.target_vocab.stop_token_ids`), z-lab's rule
(`model.generation_config.eos_token_id or tokenizer.eos_token_id`, dflash 0.1.0 benchmark.py:126) read from the
files as transformers builds the generation config, each id with its source; and `eval` stopping where z-lab's own
loop stops on a target whose generation_config.json lists two eos ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from foundation.target_vocab import stop_token_ids

MAX_NEW_TOKENS = 48


def target_copy(world, folder: Path, generation=None, config_eos="keep", raw_generation: str | None = None,
                text_config: dict | None = None) -> Path:
    """The world's target copied with its generation_config.json replaced (`generation`: a dict; None: removed;
    `raw_generation`: written as is), config.json's eos_token_id set (`config_eos`; "keep": as built) and a
    `text_config` added to it."""
    shutil.copytree(world.target, folder)
    file = folder / "generation_config.json"
    file.unlink(missing_ok=True)
    if raw_generation is not None:
        file.write_text(raw_generation)
    elif generation is not None:
        file.write_text(json.dumps(generation))
    config = json.loads((folder / "config.json").read_text())
    if config_eos != "keep":
        config["eos_token_id"] = config_eos
    if text_config is not None:
        config["text_config"] = text_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


GENERATION = "generation_config.json eos_token_id"
FROM_CONFIG = "config.json eos_token_id, no generation_config.json"
TOKENIZER = "the tokenizer's eos_token_id (tokenizer_config.json eos_token '<|endoftext|>')"
# case -> (generation_config.json, config.json eos, expected ids, expected source of each)
CASES = {
    "a list in generation_config.json": ({"eos_token_id": [0, 7]}, "keep", [0, 7], [GENERATION, GENERATION]),
    "an int in generation_config.json": ({"eos_token_id": 7}, "keep", [7], [GENERATION]),
    "no generation_config.json: config.json's": (None, 5, [5], [FROM_CONFIG]),
    "none in either: the tokenizer's": ({"pad_token_id": 0}, None, [0],
                                         [f"{TOKENIZER}: the generation config's eos_token_id "
                                          f"(generation_config.json eos_token_id) is unset"]),
    "eos 0, falsy in z-lab's `or`: the tokenizer's": ({"eos_token_id": 0}, "keep", [0],
                                                      [f"{TOKENIZER}: the generation config's eos_token_id "
                                                       f"(generation_config.json eos_token_id) is 0, falsy in "
                                                       f"z-lab's `or`"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_stop_ids_are_zlabs_on_the_model_transformers_loads(case, test_world, tmp_path):
    """Our reader's ids and sources, and the same ids from z-lab's own `stop_token_ids` on the model and tokenizer
    transformers loads from that folder (its generation config built its own way)."""
    from dflash.benchmark import stop_token_ids as zlab_stop_token_ids
    from transformers import AutoModelForCausalLM, AutoTokenizer

    generation, config_eos, ids, sources = CASES[case]
    folder = target_copy(test_world, tmp_path / "target", generation, config_eos)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    stops = stop_token_ids(folder, tokenizer)
    assert (stops.ids, [stops.sources[i] for i in stops.ids]) == (ids, sources)
    assert stops.report() == {"stop_ids": ids, "stop_id_sources": {str(i): s for i, s in zip(ids, sources)}}
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert zlab_stop_token_ids(model, tokenizer) == stops.ids


def test_without_a_generation_config_a_nested_text_config_eos_is_read(test_world, tmp_path):
    """transformers' `GenerationConfig.from_model_config` on config.json's dict: its own eos_token_id, else the
    first of decoder/generator/text_config's (a multimodal target's; a Qwen3 model cannot load one, so only the
    reader is held here)."""
    from transformers import AutoTokenizer

    folder = target_copy(test_world, tmp_path / "target", None, None, text_config={"eos_token_id": [11, 12]})
    stops = stop_token_ids(folder, AutoTokenizer.from_pretrained(str(folder)))
    where = "config.json text_config.eos_token_id, no generation_config.json"
    assert (stops.ids, stops.sources) == ([11, 12], {11: where, 12: where})


def test_a_generation_config_that_is_no_json_is_read_as_absent_as_transformers_does(test_world, tmp_path):
    from dflash.benchmark import stop_token_ids as zlab_stop_token_ids
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = target_copy(test_world, tmp_path / "target", config_eos=9, raw_generation='{"eos_token_id": [0, 7]')
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    stops = stop_token_ids(folder, tokenizer)
    assert (stops.ids, stops.sources) == ([9], {9: "config.json eos_token_id, generation_config.json is not JSON"})
    assert zlab_stop_token_ids(AutoModelForCausalLM.from_pretrained(str(folder)), tokenizer) == [9]


def test_a_target_without_any_eos_stops_nowhere(test_world, tmp_path):
    """No eos in the generation config, config.json or the tokenizer: no stop id (z-lab's own function raises on it:
    `list(None)`), said so."""
    from transformers import AutoTokenizer

    folder = target_copy(test_world, tmp_path / "target", {}, None)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.eos_token = None
    stops = stop_token_ids(folder, tokenizer)
    assert (stops.ids, stops.report()) == ([], {"stop_ids": [], "stop_id_sources": {}})
    assert stops.describe().startswith("none")


def stop_inside_a_round(output: list[int], rounds: list[int], after: int = 8) -> int | None:
    """The first position past `after` whose token the output has not had before (and is no eos 0) and that is not
    the last token of its round (the first is the prefill's; each round adds its accepted tokens): a stop there
    cuts a round of accepted proposals short."""
    ends = {sum(rounds[:r + 1]) for r in range(len(rounds))}  # each round's last position
    return next((i for i in range(after, len(output))
                 if output[i] not in output[:i] and output[i] != 0 and i not in ends), None)


def test_eval_stops_at_the_second_eos_where_zlabs_own_loop_stops(test_world, tmp_path):
    """A held-out prompt, a token k the trained target emits on it within MAX_NEW_TOKENS inside a round of accepted
    proposals (found by z-lab's own loop stopping at the world's eos 0 only), and the target copied with
    generation_config.json eos [0, k]: eval's per-prompt rounds and τ equal z-lab's `dflash_generate` stopping at
    z-lab's own `stop_token_ids(model, tokenizer)`, whose output ends on k, and eval's report names the ids and their
    source."""
    from dflash.benchmark import stop_token_ids as zlab_stop_token_ids

    from dflash_audit.audit.eval import run_eval
    from dflash_audit.flags.eval import EvalFlags
    from dflash_audit.prompts import load_prompts, tokenize_prompts
    from dflash_world.drafter import cached_test_drafter
    from drafter_files.checkpoint import load_checkpoint
    from foundation.target import load_target
    from reference_adapters.zlab_adapter import ZlabImplementation

    drafter_path = cached_test_drafter(test_world)
    ckpt = load_checkpoint(drafter_path)
    zlab = ZlabImplementation()

    def zlab_run(target_dir: Path, record: dict):
        target, tokenizer = load_target(target_dir)
        (_, ids), = tokenize_prompts(tokenizer, [record])
        twin = zlab.build_drafter(ckpt.spec, ckpt.state_dict, target)
        stops = zlab_stop_token_ids(target, tokenizer)
        with torch.inference_mode():
            run = zlab.generate(twin, target, ids, MAX_NEW_TOKENS, stops)
        return run.output_ids[0, ids.shape[1]:].tolist(), run.acceptance_lengths, stops

    for record in load_prompts(test_world.prompts):
        plain, plain_rounds, world_stops = zlab_run(test_world.target, record)
        assert world_stops == [0]
        if (stop_at := stop_inside_a_round(plain, plain_rounds)) is not None:
            break
    else:
        pytest.fail("no held-out prompt has a new token inside a round past its 8th token")
    k = plain[stop_at]
    folder = target_copy(test_world, tmp_path / "target", {"eos_token_id": [0, k]})
    output, rounds, stops = zlab_run(folder, record)
    assert stops == [0, k] and output == plain[:stop_at + 1]  # z-lab's loop stops at k, inside a round

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(record) + "\n")
    payload = run_eval(EvalFlags(drafter=drafter_path, target=folder, prompts=[str(prompts)],
                                 max_new_tokens=MAX_NEW_TOKENS, json_path=tmp_path / "eval.json"))
    (result,) = payload["prompts"]
    assert result["rounds"] == rounds and sum(rounds) + 1 == len(output)
    assert result["tau"] == pytest.approx(sum(rounds) / len(rounds))
    written = json.loads((tmp_path / "eval.json").read_text())
    assert (written["stop_ids"], written["stop_id_sources"]) == ([0, k], {"0": GENERATION, str(k): GENERATION})
