"""`trace --steps N`: the run across steps, held to speculators' TrainConfig-resolved run.

tests/trace_scripts/run_trainer.py is a team's own multi-step trainer (speculators' DFlashDraftModel, its run written
by hand as speculators' trainer runs it: Muon + AdamW, linear warmup over 1% of the total, clip 1.0). Each flag changes
one thing of the run, and each change must be exactly its own finding; the sound run none. Recorded in this process
(`record_script`, the recorder the verb's bootstrap installs), 5 steps of a schedule over 200 (warmup 2).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from dflash_audit.cli import main
from dflash_audit.trace.step_audit.audit import audit_recording
from dflash_audit.trace.run.lr_fit import fit_schedule
from dflash_audit.trace.record.recording import read_recording
from dflash_audit.trace.record.launch import record_script
from dflash_audit.trace.run.audit import audit_run
from dflash_world.target_training import distinct_random_qwen3

TRAINER = Path(__file__).resolve().parent / "trace_scripts" / "run_trainer.py"
STEPS = 5
# Each change of the run, and the one finding (component, key, severity) it must give.
CHANGES = {
    "AdamW on everything": (["--optimizer", "adamw"], ("recipe", "optimizer", "divergence")),
    "lr 10x": (["--lr", "1e-2"], ("recipe", "lr", "divergence")),
    "lr 0: the loss does not train": (["--lr", "0"], ("recipe", "lr", "divergence")),
    "no warmup": (["--warmup-ratio", "0"], ("recipe", "lr_warmup", "divergence")),
    "cosine decay": (["--schedule", "cosine"], ("recipe", "lr_schedule", "divergence")),
    "no clipping": (["--clip", "0"], ("recipe", "grad_clip", "divergence")),
    "clip at 0.5": (["--clip", "0.5"], ("recipe", "grad_clip", "divergence")),
    "gradients zeroed before the step": (["--zero-before-step"], ("loss", "zero_gradients", "divergence")),
    "a loss mask with nothing in it": (["--empty-loss-mask"], ("loss", "zero_gradients", "divergence")),
    "AdamW betas (0.9, 0.95)": (["--betas", "0.9", "0.95"], ("recipe", "optimizer_settings", "divergence")),
    "two micro-batches": (["--accum", "2"], ("recipe", "accumulation", "warning")),
    "bfloat16 master weights": (["--param-dtype", "bfloat16"], ("recipe", "precision", "divergence")),
    "first weights reloaded every step": (["--reload-each-step"], ("loss", "no_update", "divergence")),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run-target")
    distinct_random_qwen3(12, 64, 512).save_pretrained(path)
    return path


def record(target_dir: Path, out: Path, argv: list[str], steps: int = STEPS):
    record_script(TRAINER, ["--target", str(target_dir), *argv], out, steps=steps)
    return read_recording(out)


@pytest.fixture(scope="module")
def audited(target_dir, tmp_path_factory):
    runs = {}
    for name, argv in {"sound": [], **{k: v[0] for k, v in CHANGES.items()}}.items():
        runs[name] = audit_run(record(target_dir, tmp_path_factory.mktemp("run"), argv).manifest)
    return runs


def found(run):
    return [(f.component, f.key, f.severity) for f in run.findings]


def test_the_sound_run_has_no_finding(audited):
    run = audited["sound"]
    assert found(run) == [], [f.message for f in run.findings]
    assert run.facts["schedule"]["warmup"] == 2 and run.facts["schedule"]["shape"] == "linear"
    assert run.facts["schedule"]["total"] == 200
    assert [row["step"] for row in run.facts["per_step"]] == list(range(1, STEPS + 1))
    assert {o["class"].rsplit(":", 1)[-1] for o in run.facts["optimizers"]} == {"Muon", "AdamW"}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_change_of_the_run_is_exactly_its_own_finding(audited, change):
    run = audited[change]
    assert found(run) == [CHANGES[change][1]], [f.message for f in run.findings]
    assert run.findings[0].source  # the file and line of speculators the finding rests on


def test_the_numbers_are_the_planted_ones(audited):
    lr = audited["lr 10x"].findings[0]
    assert (lr.ours, lr.ref) == (pytest.approx(1e-2), pytest.approx(1e-3))
    frozen = audited["lr 0: the loss does not train"]
    assert (frozen.findings[0].ours, frozen.findings[0].ref) == (0, pytest.approx(1e-3))
    assert "the drafter does not train" in frozen.findings[0].message
    assert "the lr schedule: the base lr is 0, so there is no schedule to fit" in frozen.notes and "schedule" not in frozen.facts
    assert "zeroed between backward and step" in audited["gradients zeroed before the step"].findings[0].message
    assert "backward gives every parameter a zero gradient" in audited["a loss mask with nothing in it"].findings[0].message
    warmup = audited["no warmup"].findings[0]
    assert (warmup.ours, warmup.ref) == (0, 2) and "200" in warmup.message
    clip = audited["clip at 0.5"].findings[0]
    assert (clip.ours, clip.ref) == (0.5, 1.0) and "trainer.py:551" in clip.source
    optimizer = audited["AdamW on everything"].findings[0]
    assert "Muon" in optimizer.message and "AdamW on 36" in optimizer.ours


def test_the_full_trace_of_the_sound_run_is_clean(target_dir, tmp_path):
    report = audit_recording(record(target_dir, tmp_path, []))
    assert report.findings == [], [f.message for f in report.findings]
    assert report.facts["run"]["steps"] == STEPS


def test_a_loss_detached_from_the_drafter_is_refused_naming_it(target_dir, tmp_path):
    """A loss cut from the drafter and made to require grad: backward runs, no weight gets a gradient. No step of a
    drafter exists to audit, so the trace refuses in one line that names the cause."""
    from foundation.errors import AuditError

    with pytest.raises(AuditError, match="the loss reaches no parameter, only tensors made to require grad"):
        record(target_dir, tmp_path, ["--detach-loss"])


def test_one_step_is_not_a_run(target_dir, tmp_path):
    run = audit_run(record(target_dir, tmp_path, ["--optimizer", "adamw"], steps=1).manifest)
    assert run.findings == [] and any("--steps N" in note for note in run.notes), run.notes


def test_a_resume_that_drops_the_optimizer_state_is_found(target_dir, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt.pt"
    monkeypatch.setattr(sys, "argv", [str(TRAINER), "--target", str(target_dir), "--run", "3", "--save", str(ckpt)])
    runpy.run_path(str(TRAINER), run_name="__main__")
    sound = audit_run(record(target_dir, tmp_path / "all", ["--resume", str(ckpt)], steps=3).manifest)
    assert found(sound) == [], [f.message for f in sound.findings]
    assert sound.facts["resume"]["scheduler_last_epoch"] == [3, 3]
    fresh = audit_run(record(target_dir, tmp_path / "fresh", ["--resume", str(ckpt), "--resume-parts",
                                                              "model,scheduler"], steps=3).manifest)
    assert found(fresh) == [("recipe", "resume", "divergence")], [f.message for f in fresh.findings]
    assert "optimizer's state is fresh" in fresh.findings[0].message and fresh.findings[0].ours == 0
    # The scheduler's step dropped: the optimizer's moments carried over (at step 3), the lr back to its warmup.
    restarted = audit_run(record(target_dir, tmp_path / "restarted", ["--resume", str(ckpt), "--resume-parts",
                                                                      "model,optimizer"], steps=3).manifest)
    assert found(restarted) == [("recipe", "resume", "divergence")], [f.message for f in restarted.findings]
    assert "the scheduler starts over at step 0" in restarted.findings[0].message
    assert (restarted.findings[0].ours, restarted.findings[0].ref) == (0, 3)


# Held faster in `make test` by tests/test_trace.py's FSDP2 torchrun case: each rank's digest gathered to rank 0 and
# its own there, and that run with rank 0's digest on both ranks exactly the shard finding, its message this one's.
@pytest.mark.full
@pytest.mark.slow
def test_two_ranks_fed_the_same_shard_is_one_finding(target_dir, tmp_path, capsys):
    """Under torchrun (2 gloo ranks, the gradients averaged by hand), each rank's digest of what it embedded is
    gathered to rank 0: a trainer that feeds every rank rank 0's shard is exactly the shard finding. (Each rank its
    own shard, the sound case, is test_trace.py's torchrun test: the digests differ.)"""
    out = tmp_path / "trace"
    main(["trace", "--steps", "3", "--out", str(out), "--", str(Path(sys.executable).with_name("torchrun")),
          "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(TRAINER), "--ddp",
          "--same-shard", "--target", str(target_dir)])
    capsys.readouterr()
    recording = read_recording(out)
    assert recording.manifest["context"]["world_size"] == 2
    digests = recording.manifest["context"]["run"]["steps"][0]["ranks_embedded"]
    assert len(digests) == 2 and digests[0] == digests[1] and None not in digests
    run = audit_run(recording.manifest)
    assert found(run) == [("recipe", "shard", "divergence")], [f.message for f in run.findings]
    assert "ranks 0 and 1 were fed the same batch at step 1" in run.findings[0].message


def test_the_schedule_fit_knows_transformers_and_our_own_schedules():
    from transformers.optimization import _get_cosine_schedule_with_warmup_lr_lambda as cosine
    from transformers.optimization import _get_linear_schedule_with_warmup_lr_lambda as linear

    from impl.train import lr_factor

    fit = fit_schedule([linear(k, num_warmup_steps=3, num_training_steps=300) for k in range(7)])
    assert (fit["warmup"], fit["shape"], fit["total"]) == (3, "linear", 300)
    fit = fit_schedule([cosine(k, num_warmup_steps=0, num_training_steps=50, num_cycles=0.5) for k in range(4)])
    assert (fit["warmup"], fit["shape"], fit["total"]) == (0, "cosine", 50)
    fit = fit_schedule([lr_factor(k, 2, 40) for k in range(6)])
    assert (fit["warmup"], fit["shape"], fit["total"]) == (2, "cosine", 40) and fit["floor"] == pytest.approx(0.1)
    short = fit_schedule([linear(k, num_warmup_steps=10, num_training_steps=1000) for k in range(4)])
    assert short["warmup"] == 10 and short["shape"] is None and short["total"] is None and short["unknown"]
    one = fit_schedule([1.0, 0.99])
    assert one["shape"] is None and "a line and a cosine" in one["unknown"][0]


def test_the_reference_run_is_read_from_the_installed_speculators():
    from reference_adapters.speculators_run_recipe import run_reference

    ref = run_reference("dflash")
    assert ref.optimizer == "muon" and ref.schedule == "linear" and ref.clip_max_norm == 1.0
    assert ref.muon["lr"] == 1e-3 and ref.muon["momentum"] == 0.95 and ref.muon["weight_decay"] == 0.1
    assert ref.muon["adjust_lr_fn"] == "match_rms_adamw" and ref.adamw["weight_decay"] == 0.01
    assert ref.adamw["betas"] == (0.9, 0.999) and ref.warmup_for(5) == 0 and ref.warmup_for(200) == 2
    assert ref.sources["clip"] == "speculators/train/trainer.py:551"
    assert ref.sources["optimizer"].startswith("speculators/train/config/schema.py:")


def test_our_trainer_on_speculators_recipe_traces_clean(tiny_world, tmp_path):
    """`dflash-audit train --recipe speculators` runs speculators' run (Muon + AdamW, linear, clip 1.0): its trace
    holds no run finding; our default run (AdamW betas (0.9, 0.95), lr 6e-4, cosine) is found as exactly that."""
    main_py = Path(__file__).resolve().parents[1] / "dflash_audit" / "__main__.py"
    base = ["train", "--target", str(tiny_world / "target"), "--data", str(tiny_world / "data.jsonl"), "--steps",
            "200", "--seq-len", "64", "--batch-size", "2", "--max-anchors", "4", "--draft-layers", "2",
            "--target-layer-ids", "1,2"]
    runs = {}
    for name, extra in (("recipe", ["--recipe", "speculators"]), ("default", [])):
        record_script(main_py, [*base, "--out", str(tmp_path / f"{name}.pt"), *extra], tmp_path / name, steps=STEPS)
        runs[name] = audit_run(read_recording(tmp_path / name).manifest)
    assert found(runs["recipe"]) == [], [f.message for f in runs["recipe"].findings]
    assert runs["recipe"].facts["schedule"]["total"] == 200 and runs["recipe"].facts["schedule"]["warmup"] == 2
    assert sorted(found(runs["default"])) == [("recipe", "lr", "divergence"), ("recipe", "optimizer", "divergence"),
                                              ("recipe", "optimizer_settings", "divergence")]


def test_our_muon_split_is_speculators_split(tiny_world):
    """Which parameters Muon takes: ours (by module: linear weights that are matrices, no vocabulary output) against
    speculators' split_named_params_for_muon (by name and shape) on our drafter."""
    from speculators.train.optimizers import split_named_params_for_muon

    from impl.model import DFlashDrafter
    from impl.train import muon_split
    from tests.helpers import tiny_spec

    drafter = DFlashDrafter(tiny_spec(target_vocab_size=160, mask_token_id=159))  # a vocabulary no layer is as wide as
    ours, rest = muon_split(drafter, 160)
    theirs, their_rest = split_named_params_for_muon(drafter)
    assert {id(p) for p in ours} == {id(p) for _, p in theirs} and {id(p) for p in rest} == {id(p) for _, p in their_rest}
    assert ours and rest


# The team's forward and loss planted apart from the run's recipe: speculators' own model and loss find them.
PARITY_ONLY = {"GELU in the drafter's layers": ["--act", "gelu"], "loss decay gamma 7": ["--gamma", "7"]}


@pytest.mark.parametrize("change, parted", [("sound", None), ("AdamW on everything", (2, "update")),
                                             ("no clipping", (1, "gradient")),
                                             ("gradients zeroed before the step", (1, "gradient")),
                                             ("GELU in the drafter's layers", (1, "forward")),
                                             ("loss decay gamma 7", (1, "loss"))])
def test_step_parity_localizes_where_the_run_parts_from_speculators_step(target_dir, tmp_path, change, parted):
    """`--parity 4`: speculators' own DFlashDraftModel, its loss as its trainer resolves it and its optimizers
    (build_optimizers, resolved) run beside the recorded run from its weights, batches and anchors' random state;
    AdamW's first update is step 2 (step 1 runs at lr 0, warmup). A forward or loss parted with no recipe finding
    to explain it is the one step_parity warning."""
    argv = [] if change == "sound" else PARITY_ONLY.get(change) or CHANGES[change][0]
    record_script(TRAINER, ["--target", str(target_dir), *argv], tmp_path, steps=STEPS, parity=STEPS - 1)
    run = audit_run(read_recording(tmp_path).manifest, tmp_path)
    found_parity = run.facts["parity"]
    assert found_parity["compared"] == STEPS - 1
    assert found_parity["forward"] == "speculators' DFlashDraftModel run beside the team's on its batches"
    assert found_parity["tolerance"]["loss"] == 1e-5 and found_parity["tolerance"]["muon_update"] == 2e-2
    where = found_parity["parted"]
    assert (None if where is None else (where["step"], where["phase"])) == parted, where
    keys = [] if change == "sound" else ["step_parity"] if change in PARITY_ONLY else [CHANGES[change][1][1]]
    assert [f.key for f in run.findings] == keys, [f.message for f in run.findings]
    if change in PARITY_ONLY:
        assert run.findings[0].severity == "warning" and parted[1] in run.findings[0].message


def test_step_parity_says_when_the_drafter_is_not_speculators_model(tmp_path):
    """The run corpus's plain loop trains z-lab's DFlashDraftModel: there is no speculators forward to run beside it,
    and the parity says so rather than comparing (its gradient and update are still compared)."""
    target = tmp_path / "target"
    distinct_random_qwen3(12, 64, 512).save_pretrained(target)
    trainer = Path(__file__).resolve().parent / "run_corpus" / "run_plain_loop.py"
    record_script(trainer, ["--target", str(target), "--steps", "3"], tmp_path / "run", steps=3, parity=2)
    run = audit_run(read_recording(tmp_path / "run").manifest, tmp_path / "run")
    found_parity = run.facts["parity"]
    assert found_parity["forward"].startswith("not run beside the team's: the drafter (dflash.model:DFlashDraftModel)")
    assert found_parity["compared"] == 2 and found_parity["parted"] is None and run.findings == []


@pytest.mark.parametrize("change", list(PARITY_ONLY))
def test_the_full_trace_says_a_parted_forward_or_loss_once(target_dir, tmp_path, change):
    """In the whole trace, a forward parted from speculators' (GELU: nothing the step audit names) is the one
    step_parity warning; a loss parted where the step audit already names the cause (its decay gamma fitted at 7) is
    that finding alone, the parity a note."""
    record_script(TRAINER, ["--target", str(target_dir), *PARITY_ONLY[change]], tmp_path, steps=3, parity=2)
    report = audit_recording(read_recording(tmp_path))
    divergences = [(f.component, f.key) for f in report.findings if f.severity == "divergence"]
    parity_findings = [f for f in report.findings if f.key == "step_parity"]
    if change == "GELU in the drafter's layers":
        assert divergences == [] and [f.ours for f in parity_findings] == ["forward"], \
            [f.message for f in report.findings]
    else:
        assert parity_findings == [] and len(divergences) == 1, [f.message for f in report.findings]
        assert "7" in next(f.message for f in report.findings if f.severity == "divergence")
        assert any(n.startswith("step parity: the run parts") and "in the loss" in n for n in report.notes)


def test_a_wrapped_drafter_is_read_as_the_plain_one(target_dir, tmp_path):
    """The same run with the drafter's forward through DDP (one gloo rank, in this process) or torch.compile: the
    run and its step parity read exactly as the plain run's (the wrapper unwrapped: speculators' forward run beside
    it on the same batches), each step's loss the plain run's."""
    runs = {}
    for wrap in (None, "ddp", "compile"):
        out = tmp_path / str(wrap)
        record_script(TRAINER, ["--target", str(target_dir), *(["--wrap", wrap] if wrap else [])], out, steps=3,
                      parity=2)
        runs[wrap] = audit_run(read_recording(out).manifest, out)
    for wrap, run in runs.items():
        assert found(run) == [], (wrap, [f.message for f in run.findings])
        parity = run.facts["parity"]
        assert parity["forward"] == "speculators' DFlashDraftModel run beside the team's on its batches", wrap
        assert (parity["compared"], parity["parted"]) == (2, None), (wrap, parity)
        assert [row["loss"] for row in run.facts["per_step"]] == [row["loss"] for row in runs[None].facts["per_step"]]
