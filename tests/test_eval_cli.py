"""`dflash-audit eval`: table + JSON shape, live and offline agreement, prompts files, errors (under torchrun:
tests/test_torchrun_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_audit.cli import main
from dflash_audit.prompts import load_prompts, tokenize_prompt
from foundation.chat_template import ChatTemplate
from dflash_world.drafter import cached_test_drafter
from dflash_world.suite_placement import audit_dtype
from foundation.errors import AuditError
from foundation.placement import dtype_name


@pytest.fixture(scope="module")
def eval_inputs(test_world, tmp_path_factory):
    prompts = tmp_path_factory.mktemp("prompts") / "three.jsonl"
    lines = Path(test_world.prompts).read_text().splitlines()[:3]
    prompts.write_text("\n".join(lines) + "\n")
    return cached_test_drafter(test_world), test_world.target, prompts


def run_cli(args: list[str]) -> int:
    return main([str(a) for a in args])


@pytest.mark.dynamic
def test_eval_live_and_offline_agree_and_write_the_json_shape(eval_inputs, tmp_path, capsys):
    drafter, target, prompts = eval_inputs
    results = {}
    for method in ("dflash", "ddtree"):
        for mode in ("live", "offline"):
            out = tmp_path / f"{method}-{mode}.json"
            code = run_cli(["eval", "--drafter", drafter, "--target", target, "--prompts", prompts, "--method", method,
                            "--budget", 16, "--mode", mode, "--max-new-tokens", 48, "--json", out,
                            "--cache-dir", tmp_path / "cache", *(["--tau-bin-tokens", 64] if mode == "offline" else [])])
            assert code == 0
            results[method, mode] = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "mean τ" in table and "| prompt" in table
    live = results["dflash", "live"]
    assert set(live) >= {"method", "mode", "budget", "max_new_tokens", "prompts", "mean_tau"}
    assert (live["method"], live["mode"], live["max_new_tokens"]) == ("dflash", "live", 48)
    assert live["placement"]["dtype"] == dtype_name(audit_dtype())  # the suite's dtype, via --dtype auto
    assert results["ddtree", "offline"]["budget"] == 16
    ids = [p["id"] for p in load_prompts(prompts)]
    for (method, mode), payload in results.items():
        assert [p["id"] for p in payload["prompts"]] == ids
        for prompt in payload["prompts"]:
            assert set(prompt) == {"id", "tau", "rounds"}
            assert prompt["tau"] == pytest.approx(sum(prompt["rounds"]) / len(prompt["rounds"]))
        assert payload["mean_tau"] == pytest.approx(sum(p["tau"] for p in payload["prompts"]) / len(ids))
    for method in ("dflash", "ddtree"):
        assert results[method, "live"]["prompts"] == results[method, "offline"]["prompts"]
    # τ along the context: every round in a position bin, the drafter's marks from its checkpoint and recipe.
    along = live["along_context"]
    assert along["schema"] == "dflash-audit/tau-along-context/1" and along["bin_tokens"] == 256
    assert sum(b["rounds"] for b in along["by_position"]) == sum(len(p["rounds"]) for p in live["prompts"])
    assert sum(b["tokens"] for b in along["by_position"]) == sum(sum(p["rounds"]) for p in live["prompts"])
    assert along["marks"]["sliding_window"] == 48 and along["marks"]["trained_length"] == 256
    assert all(0 <= b["agreement"] <= 1 for b in along["by_position"] if b["agreement"] is not None)
    assert "τ along the context (256-token bins; sliding window 48" in table
    narrow = results["dflash", "offline"]["along_context"]  # --tau-bin-tokens 64: the same rounds, 64-token bins
    assert narrow["bin_tokens"] == 64 and all(b["end"] - b["start"] == 64 for b in narrow["by_position"])
    assert sum(b["rounds"] for b in narrow["by_position"]) == sum(b["rounds"] for b in along["by_position"])
    assert "τ along the context (64-token bins" in table


def test_bad_prompt_line_is_one_line_error_with_file_and_line(eval_inputs, tmp_path, capsys):
    drafter, target, _ = eval_inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "def f():"}\n{"id": "b", "text": "oops"}\n')
    code = run_cli(["eval", "--drafter", drafter, "--target", target, "--prompts", bad])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{bad}:2" in err and "'prompt' or a 'turns'" in err


@pytest.mark.parametrize("args, message", [
    (["--method", "beam"], "--method"),
    (["--mode", "online"], "--mode"),
    (["--temperature", "0.5", "--method", "ddtree"], "--temperature"),
    (["--budget", "0"], "--budget"),
])
def test_bad_options_exit_2(eval_inputs, capsys, args, message):
    drafter, target, prompts = eval_inputs
    assert run_cli(["eval", "--drafter", drafter, "--target", target, "--prompts", prompts, *args]) == 2
    assert message in capsys.readouterr().err


def test_prompt_formats_and_chat_template(test_world, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "x", "prompt": "def f():"}\n\n{"turns": ["import os", "ignored"]}\n')
    assert load_prompts(path) == [{"id": "x", "prompt": "def f():"}, {"id": "3", "prompt": "import os"}]
    path.write_text('{"id": "x", "prompt": "a"}\nnot json\n')
    with pytest.raises(AuditError, match=f"{path}:2"):
        load_prompts(path)

    tokenizer = AutoTokenizer.from_pretrained(test_world.target)
    plain = tokenize_prompt(tokenizer, "def f():", ChatTemplate.parse("off"))
    assert plain[0].tolist() == tokenizer("def f():")["input_ids"]
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"
    assert ChatTemplate.parse("auto").template(tokenizer) and ChatTemplate.parse("off").template(tokenizer) is None
    templated = tokenize_prompt(tokenizer, "def f():")
    expected = tokenizer("<user>def f():</user><bot>", add_special_tokens=False)["input_ids"]
    assert templated[0].tolist() == expected
    tokenizer.chat_template = None
    with pytest.raises(AuditError, match="no chat template"):
        tokenize_prompt(tokenizer, "def f():", ChatTemplate.parse("on"))


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])
def test_a_raw_unicode_line_separator_inside_a_prompt_is_one_record(tmp_path, char):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": f"x = 1{char}y = 2"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_prompts(path) == [{"id": "a", "prompt": f"x = 1{char}y = 2"}]


@pytest.mark.parametrize("args, message", [
    (["eval"], "Missing option '--drafter'"),
    (["eval", "--drafter", "d", "--target", "t", "--prompts", "p", "--budget", "abc"], "Invalid value for '--budget'"),
    (["evaluate"], "No such command 'evaluate'"),
])
def test_usage_errors_are_clicks_own_one_line_message(capsys, args, message):
    assert run_cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("dflash-audit: error: ") and message in err
    assert "rerun with --debug" not in err  # a usage error, not an unexpected exception
