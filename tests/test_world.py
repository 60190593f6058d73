"""The demo-world builders: corpus, tokenizer, trained target, prompts, cache."""

import json
import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from dflash_world import (
    BUILTIN_PROMPTS,
    EOS_TOKEN,
    MASK_TOKEN,
    build_target,
    cached_test_world,
    heldout_prompts,
    mask_token_id,
    stdlib_corpus,
    train_tokenizer,
    write_prompts_jsonl,
)
from dflash_world.suite_placement import world_in_suite_dtype
from dflash_world.target_training import STATS_FILE, pack_tokens
from foundation.jsonl import split_json_lines

SMALL = 300_000  # bytes of corpus for the tests that build their own pieces


@pytest.fixture(scope="module")
def train_texts():
    return stdlib_corpus("train")


@pytest.fixture(scope="module")
def heldout_texts():
    return stdlib_corpus("heldout")


@pytest.fixture(scope="module")
def tokenizer(test_world):
    return AutoTokenizer.from_pretrained(test_world.target)


@pytest.fixture(scope="module")
def target(test_world):
    return AutoModelForCausalLM.from_pretrained(test_world.target).eval()


def test_corpus_is_deterministic_bounded_and_splits_are_disjoint(train_texts, heldout_texts):
    assert stdlib_corpus("train") == train_texts
    assert len(train_texts) > 50 and len(heldout_texts) > 10
    assert not set(train_texts) & set(heldout_texts)
    small = stdlib_corpus("train", max_bytes=SMALL)
    assert 0 < sum(len(t.encode()) for t in small) <= SMALL
    # A small budget samples the whole library, not the alphabetically first files.
    everything = stdlib_corpus("train", max_bytes=1 << 40)
    assert set(small) <= set(everything) and small != everything[: len(small)]
    for text in small:
        compile(text, "<stdlib>", "exec", dont_inherit=True)  # real Python source
    with pytest.raises(ValueError):
        stdlib_corpus("validation")


def test_tokenizer_round_trips_python_source(tokenizer, heldout_texts):
    samples = heldout_texts[:5] + [
        "def f(a, b):\n\treturn a . b , [ ]  \r\n",
        'π = "naïve café ✓"  # non-ASCII\n',
        "x = 1" + EOS_TOKEN + "y" + MASK_TOKEN,
    ]
    for text in samples:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    ids = tokenizer(heldout_texts[0])["input_ids"]
    assert len(heldout_texts[0]) / len(ids) > 2.2  # BPE actually merged (2.4 chars/token measured)


def test_tokenizer_special_tokens(tokenizer, target):
    vocab = target.config.vocab_size
    assert len(tokenizer) == vocab
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == EOS_TOKEN
    mask = mask_token_id(tokenizer)
    assert mask != tokenizer.eos_token_id and max(mask, tokenizer.eos_token_id) < vocab
    assert tokenizer(MASK_TOKEN)["input_ids"] == [mask]  # one special token, never split
    assert not tokenizer.chat_template
    assert tokenizer("x")["input_ids"] == tokenizer.convert_tokens_to_ids(["x"])  # no BOS added


def test_target_config_and_saved_files(test_world, target, tokenizer):
    assert isinstance(target, Qwen3ForCausalLM)
    config = target.config
    assert config.tie_word_embeddings is False
    assert config.eos_token_id == config.pad_token_id == tokenizer.eos_token_id
    assert target.generation_config.eos_token_id == tokenizer.eos_token_id
    assert target.get_input_embeddings().weight.data_ptr() != target.lm_head.weight.data_ptr()
    assert next(target.parameters()).dtype == torch.float32
    assert (test_world.target / "model.safetensors").is_file()
    assert not list(test_world.root.glob(".target.*"))  # no staging dir left behind


def test_target_learned(test_world, target, tokenizer, heldout_texts):
    stats = json.loads((test_world.target / STATS_FILE).read_text())
    chance = math.log(target.config.vocab_size)
    assert abs(stats["initial_loss"] - chance) < 0.3
    assert stats["final_loss"] < chance - 2.2
    # The saved weights, on code the target never saw, do as well as training said.
    rows = pack_tokens(tokenizer, heldout_texts, 256)[:8]
    with torch.no_grad():
        heldout_loss = target(input_ids=rows, labels=rows).loss.item()
    assert heldout_loss < chance - 1.8  # 5.40 measured, chance 7.62


def test_greedy_generation_is_deterministic(target, tokenizer):
    prompt = BUILTIN_PROMPTS[0]["prompt"]
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    runs = [target.generate(ids, max_new_tokens=24, do_sample=False) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape[1] > ids.shape[1]
    assert tokenizer.decode(runs[0][0]).startswith(prompt)


def test_build_target_replaces_out_dir_atomically(tmp_path):
    texts = stdlib_corpus("train", max_bytes=SMALL)
    tok = train_tokenizer(texts, vocab_size=300)
    out = tmp_path / "target"
    out.mkdir()
    (out / "stale.txt").write_text("from an older build")
    stats = build_target(
        out, tok, texts, hidden_size=32, num_layers=1, heads=2, kv_heads=1, head_dim=16,
        intermediate_size=64, seq_len=32, steps=3, batch_size=2, lr=1e-3, seed=0, progress=False,
    )
    assert {"initial_loss", "final_loss", "params", "seconds"} <= stats.keys()
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert out.stat().st_mode & 0o777 == 0o755
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.num_hidden_layers == 1 and reloaded.config.vocab_size == len(tok)


def test_heldout_prompts(train_texts, heldout_texts):
    prompts = heldout_prompts(heldout_texts, 10, seed=3, avoid=train_texts)
    assert prompts == heldout_prompts(heldout_texts, 10, seed=3, avoid=train_texts)
    assert prompts != heldout_prompts(heldout_texts, 10, seed=4, avoid=train_texts)
    assert len(prompts) == 10 and len({p["id"] for p in prompts}) == 10
    for p in prompts:
        text = p["prompt"]
        assert 200 <= len(text) <= 400 and not text[-1].isspace()
        source = next(t for t in heldout_texts if text in t)
        start = source.index(text)
        rest_of_line = source[start + len(text):].split("\n", 1)[0]
        assert (start == 0 or source[start - 1] == "\n") and not rest_of_line.strip()
        assert not any(text in t for t in train_texts)


def test_builtin_prompts(tokenizer):
    assert len(BUILTIN_PROMPTS) >= 10
    assert len({p["id"] for p in BUILTIN_PROMPTS}) == len(BUILTIN_PROMPTS)
    for p in BUILTIN_PROMPTS:
        assert not p["prompt"][-1].isspace()
        # Short enough that prompt plus a long continuation stays within the trained length.
        assert 0 < len(tokenizer(p["prompt"])["input_ids"]) <= 80


def test_write_prompts_jsonl(tmp_path):
    path = tmp_path / "sub" / "prompts.jsonl"
    write_prompts_jsonl(path, BUILTIN_PROMPTS[:3])
    write_prompts_jsonl(path, BUILTIN_PROMPTS)  # overwrites
    lines = split_json_lines(path.read_text(encoding="utf-8").rstrip("\n"))
    assert [json.loads(line) for line in lines] == BUILTIN_PROMPTS
    assert [p.name for p in path.parent.iterdir()] == ["prompts.jsonl"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_cached_test_world_is_reused(test_world):
    config = test_world.target / "config.json"
    built_at = config.stat().st_mtime_ns
    started = time.monotonic()
    again = world_in_suite_dtype(cached_test_world())  # the fixture's: the world, its target in the suite's dtype
    assert time.monotonic() - started < 2
    assert again == test_world and again.complete()
    assert config.stat().st_mtime_ns == built_at
    prompts = [json.loads(line) for line in split_json_lines(test_world.prompts.read_text()) if line]
    assert len(prompts) >= 4 and all({"id", "prompt"} <= p.keys() for p in prompts)
