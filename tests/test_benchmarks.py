"""Benchmark prompt sets read from each benchmark's own row format (`--prompts NAME:PATH`), and the chat
template flags. No model: seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dflash.benchmark import DATASETS, _select_dataset

from dflash_audit.audit.eval import prompt_set_from_flag
from foundation.benchmarks.sets import BENCHMARKS, parse_prompts_flag, read_prompt_set
from foundation.chat_template import ChatTemplate, thinking_settings
from foundation.errors import AuditError
from tests.helpers import cli_in_process

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"
FILES = {"gsm8k": "gsm8k.jsonl", "math500": "math500.jsonl", "aime": "aime.jsonl", "humaneval": "humaneval.jsonl",
         "mbpp": "mbpp.jsonl", "mt-bench": "mt_bench.jsonl", "alpaca": "alpaca.jsonl",
         "livecodebench": "livecodebench.jsonl"}
THINKING_TEMPLATE = Path(__file__).parents[1] / "dflash_world" / "chat_template_thinking.jinja"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / FILES[name]).read_text().split("\n") if line.strip()]


def test_every_benchmark_has_a_fixture_in_its_own_format():
    assert set(FILES) == set(BENCHMARKS)
    for name, file in FILES.items():
        prompt_set = read_prompt_set(name, FIXTURES / file)
        assert prompt_set.describe()["count"] == len(rows(name)) == prompt_set.rows
        assert all(p.turns and all(t.strip() for t in p.turns) for p in prompt_set.prompts)
        assert len({p.id for p in prompt_set.prompts}) == len(prompt_set.prompts)


@pytest.mark.parametrize("name", ["gsm8k", "math500", "humaneval", "mbpp"])
def test_zlab_sets_render_exactly_as_zlab_formats_them(name):
    """z-lab's own formatter output, row by row (its benchmark keys math500 as 'math500', mt-bench as 'mt-bench')."""
    expected = [DATASETS[name]["format"](row) for row in rows(name)]
    assert [p.prompt for p in read_prompt_set(name, FIXTURES / FILES[name]).prompts] == expected


def test_references_and_ids_come_from_each_sets_own_fields():
    gsm = read_prompt_set("gsm8k", FIXTURES / "gsm8k.jsonl").prompts
    assert gsm[0].reference.endswith("#### 72") and "Natalia" in gsm[0].prompt
    humaneval = read_prompt_set("humaneval", FIXTURES / "humaneval.jsonl").prompts
    assert humaneval[0].id == "HumanEval/0" and humaneval[1].reference == "    return number % 1.0\n"
    assert humaneval[0].prompt.startswith("Write a solution") and "def has_close_elements" in humaneval[0].prompt
    mbpp = read_prompt_set("mbpp", FIXTURES / "mbpp.jsonl").prompts
    assert mbpp[0].id == "2" and mbpp[0].reference.startswith("def similar_elements")
    math = read_prompt_set("math500", FIXTURES / "math500.jsonl").prompts
    assert math[1].id == "test/algebra/2592.json" and "26000" in math[1].reference


def test_mt_bench_keeps_both_turns_from_either_layout(tmp_path):
    hf = read_prompt_set("mt-bench", FIXTURES / "mt_bench.jsonl").prompts
    assert [len(p.turns) for p in hf] == [2, 2] and hf[0].id == "81" and hf[0].reference is None
    assert hf[1].turns == rows("mt-bench")[1]["prompt"]
    fastchat = tmp_path / "question.jsonl"  # FastChat's layout: question_id + turns
    fastchat.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["one", "two"]}) + "\n")
    assert read_prompt_set("mt-bench", fastchat).prompts[0].turns == ["one", "two"]


def test_aime_goes_through_zlab_math_formatter_with_any_problem_field(tmp_path):
    prompt = read_prompt_set("aime", FIXTURES / "aime.jsonl").prompts[0]
    assert prompt.prompt == DATASETS["math500"]["format"]({"problem": rows("aime")[0]["problem"]})
    assert prompt.id == "60" and prompt.reference == "$204$"
    other = tmp_path / "aime25.jsonl"
    other.write_text(json.dumps({"Problem": "Find x.", "Answer": 7}) + "\n")
    converted = read_prompt_set("aime25", other).prompts[0]
    assert converted.prompt.startswith("Find x.\n") and converted.reference == "7"


def test_alpaca_and_livecodebench_renderings():
    alpaca = read_prompt_set("alpaca", FIXTURES / "alpaca.jsonl").prompts
    assert alpaca[0].prompt == "Give three tips for staying healthy."  # empty input: the instruction alone
    assert alpaca[1].prompt == "Write a Python function that reverses a string.\n\ndef reverse(s):"
    assert alpaca[1].reference.startswith("def reverse")
    lcb = read_prompt_set("livecodebench", FIXTURES / "livecodebench.jsonl").prompts
    assert lcb[0].id == "1873_A" and "standard input" in lcb[0].prompt and "```python" in lcb[0].prompt
    assert "class Solution:" in lcb[1].prompt and "starter code" in lcb[1].prompt and lcb[1].reference is None


def test_parquet_through_datasets_local_loader(tmp_path):
    from datasets import Dataset

    path = tmp_path / "test-00000-of-00001.parquet"
    Dataset.from_list(rows("gsm8k")).to_parquet(str(path))
    from_parquet = read_prompt_set("gsm8k", path)
    assert [p.prompt for p in from_parquet.prompts] == [p.prompt for p in read_prompt_set("gsm8k", FIXTURES /
                                                                                          "gsm8k.jsonl").prompts]


def test_selection_is_zlabs_seeded_selection():
    prompt_set = read_prompt_set("humaneval", FIXTURES / "humaneval.jsonl", max_samples=2)
    every = read_prompt_set("humaneval", FIXTURES / "humaneval.jsonl").prompts
    assert [p.id for p in prompt_set.prompts] == [p.id for p in _select_dataset(every, 2)]
    assert "2 of 3" in prompt_set.describe()["selection"]


def test_prompts_flag_parsing(tmp_path):
    assert parse_prompts_flag("gsm8k:/data/test.jsonl") == ("gsm8k", Path("/data/test.jsonl"))
    assert parse_prompts_flag("MATH-500:x.parquet") == ("math500", Path("x.parquet"))
    assert parse_prompts_flag("prompts.jsonl") == (None, Path("prompts.jsonl"))
    with pytest.raises(AuditError, match="unknown benchmark"):
        parse_prompts_flag("gsm9k:data.jsonl")
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"id": "a", "prompt": "def f():"}\n')
    assert prompt_set_from_flag(str(plain)).prompts[0].turns == ["def f():"]


@pytest.mark.parametrize("name,row,message", [
    ("gsm8k", {"query": "x"}, "needs a 'question' field"),
    ("mt-bench", {"prompt": "one turn"}, "non-empty list"),
    ("alpaca", {"instruction": ""}, "non-empty string"),
    ("livecodebench", {"question_content": "q", "starter_code": 3}, "'starter_code' must be a string"),
])
def test_a_row_without_its_sets_fields_is_one_clear_error(tmp_path, name, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(AuditError, match=message):
        read_prompt_set(name, path)


def test_bad_benchmark_files_on_the_command_line_exit_2_in_one_line(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    missing_field = tmp_path / "gsm.jsonl"
    missing_field.write_text('{"problem": "wrong set"}\n')
    for prompts, named in ((f"gsm8k:{bad}", "not a readable parquet file"), (f"gsm8k:{missing_field}", "'question'"),
                           (f"nosuchset:{missing_field}", "unknown benchmark")):
        run = cli_in_process("eval", "--drafter", tmp_path / "d.pt", "--target", tmp_path, "--prompts", prompts,
                             "--table")
        assert run.returncode == 2, run.stderr
        lines = run.stderr.strip().split("\n")
        assert len(lines) == 1 and lines[0].startswith("dflash-audit: error:") and "Traceback" not in run.stderr
        assert named in lines[0], lines[0]


def test_chat_template_flags(tmp_path):
    from dflash_world.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    assert ChatTemplate.parse("auto").template(tokenizer) is None  # the world's tokenizer has no template
    with pytest.raises(AuditError, match="no chat template is applied"):
        ChatTemplate.parse("auto", '{"enable_thinking": false}').check_kwargs(tokenizer)
    with pytest.raises(AuditError, match="JSON object"):
        ChatTemplate.parse("auto", "[1]")
    with pytest.raises(AuditError, match="neither auto, none nor"):
        ChatTemplate.parse(str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(AuditError, match="not a Jinja template"):
        ChatTemplate.parse(str(broken))
    template = ChatTemplate.parse(str(THINKING_TEMPLATE), '{"enable_thinking": false}')
    template.check_kwargs(tokenizer)
    with pytest.raises(AuditError, match="never reads 'reasoning_effort'"):
        ChatTemplate.parse(str(THINKING_TEMPLATE), '{"reasoning_effort": "high"}').check_kwargs(tokenizer)
    off = tokenizer.decode(template.render(tokenizer, [{"role": "user", "content": "hi"}]))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    settings = thinking_settings(ChatTemplate.parse(str(THINKING_TEMPLATE)), tokenizer)
    assert {k: v.kwargs for k, v in settings.items()} == {"on": {"enable_thinking": True},
                                                          "off": {"enable_thinking": False}}
    on = tokenizer.decode(settings["on"].render(tokenizer, [{"role": "user", "content": "hi"}]))
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert template.describe(tokenizer)["kwargs"] == {"enable_thinking": False}
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(AuditError, match="no enable_thinking switch"):
        thinking_settings(ChatTemplate.parse(str(plain)), tokenizer)
