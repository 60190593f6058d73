"""`--device`, `--dtype`, `--device-map` resolved in one place; the memory plan that refuses a run
that does not fit, before any target weight is read; progress lines in logs."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from rich.console import Console
from transformers import AutoConfig

from dflash_audit.cli import main
from dflash_audit.audit.eval import run_eval
from dflash_audit.flags.compare import CompareFlags
from dflash_audit.flags.eval import EvalFlags
from dflash_audit.progress import PlainProgress, TokenCount
from dflash_world.drafter import cached_test_drafter
from dflash_world.suite_placement import audit_dtype
from foundation.errors import AuditError
from foundation.placement import CPU_FLOAT32, Placement, resolve_placement
from foundation.target import load_target_model
from drafter_files.checkpoint import load_checkpoint
from impl.memory_plan import GB, check_plan, plan_memory, target_bytes

TORCHRUN_RANK_1 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}


def test_auto_is_cuda_when_there_is_one_and_the_targets_own_dtype(test_world):
    placement = resolve_placement(target_dir=test_world.target, cuda_count=0)
    # The world's target declares float32; under DFLASH_AUDIT_DTYPE its copy declares the suite's dtype.
    assert (placement.device, placement.dtype, placement.dtype_source) == (
        torch.device("cpu"), audit_dtype(), "the target's config.json")
    assert resolve_placement(target_dir=test_world.target, cuda_count=2).device == torch.device("cuda", 0)
    # Under torchrun each rank takes GPU LOCAL_RANK.
    assert resolve_placement(env=TORCHRUN_RANK_1, cuda_count=2).device == torch.device("cuda", 1)
    assert resolve_placement("cuda:1", "bfloat16", cuda_count=2).dtype == torch.bfloat16
    assert CompareFlags(ours="a", ref="b", dtype="bfloat16, float32").dtype == ["bfloat16", "float32"]


def test_the_dtype_a_config_declares_or_does_not(test_world, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(test_world.target, target)
    config = json.loads((target / "config.json").read_text())
    for declared, expected, source in (("bfloat16", torch.bfloat16, "the target's config.json"),
                                       (None, torch.float32, "not declared in the target's config.json: float32")):
        config.pop("dtype", None), config.pop("torch_dtype", None)
        if declared:
            config["torch_dtype"] = declared  # the older spelling is read too
        (target / "config.json").write_text(json.dumps(config))
        placement = resolve_placement("cpu", target_dir=target)
        assert (placement.dtype, placement.dtype_source) == (expected, source)
    config["dtype"] = "float8_e4m3fn"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(AuditError, match="declares dtype 'float8_e4m3fn'.*pass --dtype"):
        resolve_placement("cpu", target_dir=target)


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(device="cuda"), {}, "no CUDA device is available here"),
    (dict(device_map="auto"), TORCHRUN_RANK_1, "use one or the other"),
    (dict(device="cuda:0"), TORCHRUN_RANK_1, "every rank would use the same GPU"),
])
def test_bad_placement_flags_are_one_line_errors(kwargs, env, message):
    with pytest.raises(AuditError, match=message):
        resolve_placement(env=env, cuda_count=0 if kwargs.get("device") == "cuda" else 2, **kwargs)


@pytest.mark.parametrize("flag, value, message", [
    ("--device", "tpu", "--device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("--dtype", "fp8", "--dtype: must be one of auto, bfloat16, float16, float32, got 'fp8'"),
    ("--dtype", "bfloat16,bfloat16", "--dtype: names bfloat16 twice"),
    ("--device-map", "balanced", "--device-map: must be auto, got 'balanced'"),
])
def test_bad_placement_flags_are_refused_by_their_declaration(capsys, flag, value, message):
    assert main(["compare", "--ours", "a", "--ref", "b", flag, value]) == 2
    assert capsys.readouterr().err.strip() == f"dflash-audit: error: {message}"


def test_cuda_without_a_gpu_exits_2_with_one_line(test_world, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    code = main(["eval", "--drafter", str(cached_test_drafter(test_world)), "--target", str(test_world.target),
                 "--prompts", str(test_world.prompts), "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err] and "no CUDA device is available" in err


def test_target_bytes_from_the_meta_device_are_the_loaded_weights(test_world):
    config = AutoConfig.from_pretrained(test_world.target)
    target = load_target_model(test_world.target)
    loaded = sum(p.numel() * p.element_size() for p in target.parameters())
    assert target_bytes(config, torch.float32) >= loaded  # + float buffers (rotary inv_freq), nothing else
    assert target_bytes(config, torch.float32) - loaded < 1024
    assert target_bytes(config, torch.bfloat16) * 2 - target_bytes(config, torch.float32) < 1024


def test_the_plan_refuses_a_run_that_does_not_fit_with_the_numbers_and_the_fix(test_world):
    config = AutoConfig.from_pretrained(test_world.target)
    spec = load_checkpoint(cached_test_drafter(test_world)).spec
    plan = plan_memory(config, torch.float32, [spec, spec], [100] * 8, 64)
    check_plan(plan, CPU_FLOAT32, free_on_host=plan.total)  # exactly enough: fine
    with pytest.raises(AuditError) as refused:
        check_plan(plan, CPU_FLOAT32, free_on_host=plan.total - 1, cuda_count=0)
    message = str(refused.value)
    assert message.startswith("memory plan does not fit: target ") and "\n" not in message
    for part in (plan.target, plan.drafters, plan.cache, plan.workspace, plan.total):
        assert f"{part / GB:.2f} GB" in message
    assert "the host has" in message and "--dtype bfloat16" in message and "--device-map" not in message

    gpu = Placement(torch.device("cuda", 0), torch.bfloat16, "test")
    plan = plan_memory(config, torch.bfloat16, [spec], [100] * 8, 64)
    with pytest.raises(AuditError, match=r"cuda:0 has 0\.00 GB free .*try --device-map auto"):
        check_plan(plan, gpu, free_on_devices=[1000], free_on_host=10 * plan.total, cuda_count=1)
    sharded = Placement(torch.device("cuda", 0), torch.bfloat16, "test", device_map="auto")
    check_plan(plan, sharded, free_on_devices=[1000, 1000], free_on_host=10 * plan.total, cuda_count=2)  # host takes it
    with pytest.raises(AuditError, match="2 GPU\\(s\\) have 0.00 GB free and the host"):
        check_plan(plan, sharded, free_on_devices=[1000, 1000], free_on_host=plan.cache, cuda_count=2)


def test_eval_refuses_before_the_target_loads(test_world, tmp_path, monkeypatch):
    def no_target(*args, **kwargs):
        raise AssertionError("the target's weights were read although the plan does not fit")

    monkeypatch.setattr("foundation.target.load_target_model", no_target)
    with pytest.raises(AuditError, match="memory plan does not fit.*the host has 0.00 GB available"):
        run_eval(EvalFlags(drafter=cached_test_drafter(test_world), target=test_world.target,
                           prompts=[str(test_world.prompts)], max_new_tokens=8, device="cpu"),
                 memory={"free_on_host": 1000, "cuda_count": 0})


def test_progress_lines_in_a_log_say_prompts_tokens_rate_and_eta():
    out = io.StringIO()
    now = [0.0]
    bar = PlainProgress(Console(file=out, width=200), "eval dflash (live)", TokenCount(4, 32, clock=lambda: now[0]))
    for tokens in (30, 32, 32, 20):  # two prompts stop early: their unused budget leaves the total
        now[0] += 6.0
        bar.advance(tokens)
    lines = out.getvalue().splitlines()
    # at most one line per 10 s, and always the last one; the ETA is the tokens left at the rate so far
    assert lines == ["eval dflash (live): 2/4 prompts, 62/126 tokens, 5 tok/s, ETA 0:00:12",
                     "eval dflash (live): 4/4 prompts, 114/114 tokens, 5 tok/s, ETA 0:00:00"]


def test_compare_progress_counts_the_tokens_of_every_pass():
    """The target's pass over each prompt, then two drafters x two methods; a found cache skips its pass."""
    now = [0.0]
    count = TokenCount(3, 16, passes=5, clock=lambda: now[0])
    count.skip(3)  # the cache was found: the target generates nothing
    assert count.total == 3 * 4 * 16 and count.line().startswith("3/15 prompt passes (3 prompts x 5), 0/192 tokens")
    for _ in range(12):
        now[0] += 1.0
        count.advance(16)
    assert count.finished and (count.tokens, count.total) == (192, 192) and count.eta() == 0
