"""The run corpus (tests/run_corpus/, written apart from the audit and reading none of its code): each of its
trainers' runs traced for 8 steps of a 400-step plan, sound and with each planted fault; the sound run has no run
finding, each fault is exactly one (its component, key and severity here), with the numbers it planted."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_audit.trace.record.recording import read_recording
from dflash_audit.trace.record.launch import record_script
from dflash_audit.trace.run.audit import audit_run
from dflash_world.target_training import distinct_random_qwen3

CORPUS = Path(__file__).resolve().parent / "run_corpus"
TRAINERS = sorted(CORPUS.glob("run_*.py"))
STEPS = 8
FAULTS = {"adamw_only": ("recipe", "optimizer", "divergence"), "lr_10x": ("recipe", "lr", "divergence"),
          "no_warmup": ("recipe", "lr_warmup", "divergence"), "no_clip": ("recipe", "grad_clip", "divergence"),
          "frozen_loss": ("loss", "zero_gradients", "divergence")}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run-corpus-target")
    distinct_random_qwen3(12, 64, 512).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def audited(target_dir, tmp_path_factory):
    runs = {}
    for trainer in TRAINERS:
        for fault in (None, *FAULTS):
            out = tmp_path_factory.mktemp("run")
            record_script(trainer, ["--target", str(target_dir), "--steps", str(STEPS),
                                    *(["--fault", fault] if fault else [])], out, steps=STEPS)
            runs[trainer.stem, fault] = audit_run(read_recording(out).manifest, out)
    return runs


def test_the_corpus_holds_two_trainers():
    assert [p.stem for p in TRAINERS] == ["run_accelerate", "run_plain_loop"]


@pytest.mark.parametrize("trainer", [p.stem for p in TRAINERS])
def test_the_sound_run_is_clean(audited, trainer):
    run = audited[trainer, None]
    assert run.findings == [], [f.message for f in run.findings]
    schedule = run.facts["schedule"]
    assert (schedule["warmup"], schedule["shape"], schedule["total"]) == (4, "linear", 400), schedule


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("trainer", [p.stem for p in TRAINERS])
def test_each_fault_is_exactly_one_finding(audited, trainer, fault):
    run = audited[trainer, fault]
    assert [(f.component, f.key, f.severity) for f in run.findings] == [FAULTS[fault]], \
        [f.message for f in run.findings]


@pytest.mark.parametrize("trainer", [p.stem for p in TRAINERS])
def test_the_numbers_are_the_planted_ones(audited, trainer):
    assert audited[trainer, "lr_10x"].findings[0].ours == pytest.approx(1e-2)
    warmup = audited[trainer, "no_warmup"].findings[0]
    assert (warmup.ours, warmup.ref) == (0, 4) and "400" in warmup.message
    assert "AdamW on" in audited[trainer, "adamw_only"].findings[0].ours
