"""`dflash-audit trace`: a team's own trainer traced for one step, each planted bug found as exactly its own finding.

`examples/own_trainer.py` (z-lab's DFlashDraftModel, no project code) is recorded once per variant in this process
(`record_script`, the recorder the verb's bootstrap installs), on a 12-layer random Qwen3 whose layers, norms and head
differ enough to be told apart by value (the test world's 4-layer target gives z-lab's layer rule a single layer).
One run goes through the CLI and a child process, as a user runs it; the bad inputs of the issue each get one line.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_audit.cli import main
from dflash_audit.trace.step_audit.audit import audit_recording
from dflash_audit.trace.record.recording import COMPILE_DISABLED, MANIFEST, PARITY, TENSORS, read_recording
from dflash_audit.trace.record.launch import record_script
from dflash_audit.trace.run.audit import RUN_KEYS, RunAudit, audit_run, parity
from dflash_world.target_training import distinct_random_qwen3
from foundation.errors import AuditError

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "own_trainer.py"
SCRIPTS = Path(__file__).resolve().parent / "trace_scripts"

# The ten planted bugs: flags, and the one finding (component, key) each must give.
BUGS = {
    "fc fed 4 of 5": (["--fc-drop-last"], ("fc_dims", "fc_layers")),
    "targets from layer n-3": (["--target-layer", "9"], ("targets", "target_source")),
    "targets from the raw last layer": (["--raw-targets"], ("targets", "target_source")),
    "targets shifted by one": (["--target-shift", "1"], ("target_alignment", "shift")),
    "gamma 7": (["--gamma", "7"], ("recipe", "gamma")),
    "noise 0.5 on the targets": (["--target-noise", "0.5"], ("noise", "targets")),
    "noise on the targets, not the inputs": (["--noise-to-targets", "0.1"], ("noise", "targets")),
    "CE on the data's next tokens": (["--ce-from-data"], ("targets", "target_source")),
    "mask token is the pad id": (["--mask-is-pad"], ("mask_token_validity", "mask_is_pad")),
    "block one slot short": (["--block-short"], ("block_size", "block_length")),
}
EXTRA = {"sound": [], "input noise": ["--input-noise", "0.05"]}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """12 decoder layers, hidden 64, its tensors told apart by value as a trained model's are."""
    path = tmp_path_factory.mktemp("trace-target")
    model = distinct_random_qwen3(12, 64, 512)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def traced(target_dir, tmp_path_factory):
    """Every variant recorded (one step) and audited once."""
    reports = {}
    for name, argv in {**{k: v[0] for k, v in BUGS.items()}, **EXTRA}.items():
        out = tmp_path_factory.mktemp("rec")
        record_script(TRAINER, ["--target", str(target_dir), *argv], out)
        reports[name] = audit_recording(read_recording(out))
    return reports


def real(findings):
    return [f for f in findings if f.severity != "info"]


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_planted_bug_is_exactly_its_own_finding(traced, bug):
    report = traced[bug]
    found = [(f.component, f.key) for f in real(report.findings)]
    assert found == [BUGS[bug][1]], [f.message for f in report.findings]
    assert report.exit_status == 1
    assert report.findings[0].pitfall is not None


def test_the_numbers_are_the_planted_ones(traced):
    fc = traced["fc fed 4 of 5"].findings[0]
    assert (fc.ours, fc.ref) == ([1, 3, 5, 7], [1, 3, 5, 7, 9])
    assert "build_target_layer_ids" in fc.message
    layer = traced["targets from layer n-3"].findings[0]
    assert "layer 9" in layer.ours and layer.pitfall == 3
    gamma = traced["gamma 7"].findings[0]
    assert gamma.ours == pytest.approx(7.0, rel=1e-4) and gamma.ref == 4.0
    noise = traced["noise 0.5 on the targets"].findings[0]
    assert noise.ours == pytest.approx(0.5, rel=0.05) and noise.pitfall == 15
    assert traced["targets shifted by one"].findings[0].ours == 1


def test_sound_trainer_has_no_finding(traced):
    report = traced["sound"]
    assert report.findings == [] and report.exit_status == 0
    assert not [row for row in report.tensors if row.what.startswith("unexplained")]
    assert report.flow["fc_layers"] == [1, 3, 5, 7, 9] and report.flow["target_shift"] == 0


def test_noise_on_the_drafters_inputs_is_augmentation(traced):
    report = traced["input noise"]
    assert report.exit_status == 0
    (finding,) = report.findings
    assert (finding.component, finding.severity, finding.pitfall) == ("noise", "info", 15)
    assert finding.ours == pytest.approx(0.05, rel=0.05)


def test_speculators_own_training_step_traces_clean(target_dir, tmp_path):
    record_script(SCRIPTS / "speculators_step.py", ["--target", str(target_dir)], tmp_path)
    report = audit_recording(read_recording(tmp_path))
    assert report.findings == [], [f.message for f in report.findings]
    assert report.flow["target_shift"] == 0 and "exp(-(k-1)/4)" in report.flow["weights"]
    assert not [row for row in report.tensors if row.what.startswith("unexplained")]


def test_the_verb_runs_the_command_and_rereads_its_recording(target_dir, tmp_path, capsys):
    out = tmp_path / "tr<i>ace"  # user text on the page is escaped
    status = main(["trace", "--out", str(out), "--json", str(tmp_path / "r.json"), "--", sys.executable, str(TRAINER),
                   "--target", str(target_dir), "--gamma", "7", "--fc-drop-last"])
    printed = capsys.readouterr().out
    assert status == 1, printed
    assert "recipe:gamma" in printed and "fc_dims:fc_layers" in printed and "2 divergences" in printed
    data = json.loads((out / "report.json").read_text())
    assert data["schema"] == "dflash-audit/trace/1" and data == json.loads((tmp_path / "r.json").read_text())
    assert data["facts"]["target"]["placement"] == ["cpu"] and data["facts"]["drafter"]["placement"] == ["cpu"]
    page = (out / "index.html").read_text()
    assert "<title>dflash-audit trace" in page and page.count('class="bad"') == 2
    assert "tr<i>ace" not in page and "tr&lt;i&gt;ace" in page
    assert main(["trace", "--from", str(out)]) == 1  # re-audited without retraining: the same findings
    assert json.loads((out / "report.json").read_text())["findings"] == data["findings"]


def test_the_one_line_is_a_no_op_without_the_tool_and_imports_no_torch():
    code = ("import sys; from dflash_audit import trace; trace.step(None); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_AUDIT_TRACE")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text("import torch\nfrom transformers import AutoModelForCausalLM\nfrom dflash_audit import trace\n"
                    + body)
    return path


def test_bad_scripts_are_one_line(target_dir, tmp_path):
    never = script(tmp_path, "print('no step')\n")
    with pytest.raises(AuditError, match="without calling trace.step"):
        record_script(never, [], tmp_path / "a")
    frozen = script(tmp_path, f"t = AutoModelForCausalLM.from_pretrained({str(target_dir)!r})\n"
                              "loss = t(torch.tensor([[1, 2, 3]])).logits.sum() * 0\n"
                              "t.requires_grad_(False)\n"
                              "trace.step(t(torch.tensor([[1, 2, 3]])).logits.sum())\n")
    with pytest.raises(AuditError, match="does not depend on any trainable parameter"):
        record_script(frozen, [], tmp_path / "b")
    second = tmp_path / "second-target"
    second.mkdir()
    for f in target_dir.iterdir():
        (second / f.name).write_bytes(f.read_bytes())
    two = script(tmp_path, f"a = AutoModelForCausalLM.from_pretrained({str(target_dir)!r}).requires_grad_(False)\n"
                           f"b = AutoModelForCausalLM.from_pretrained({str(second)!r}).requires_grad_(False)\n"
                           "w = torch.nn.Linear(512, 512)\n"
                           "ids = torch.tensor([[1, 2, 3]])\n"
                           "trace.step(w(a(ids).logits + b(ids).logits).sum())\n")
    with pytest.raises(AuditError, match="two or more candidate targets.*--target"):
        record_script(two, [], tmp_path / "c")
    record_script(two, [], tmp_path / "d", target=second)  # --target settles it
    assert read_recording(tmp_path / "d").steps[0]["target"]["path"] == str(second)


def test_a_compiled_step_runs_eagerly_while_recorded_and_the_report_says_so(target_dir, tmp_path):
    """torch.compile on the drafter (fullgraph) and on the whole step (backward and optimizer step inside): the
    recorder runs both eagerly, so every module hook fires; the step is recorded and the report notes it."""
    compiled = script(tmp_path, f"t = AutoModelForCausalLM.from_pretrained({str(target_dir)!r}).requires_grad_(False)\n"
                                "w = torch.nn.Linear(512, 512)\n"
                                "draft = torch.compile(w, fullgraph=True, backend='aot_eager')\n"
                                "optim = torch.optim.SGD(w.parameters(), lr=0.1)\n"
                                "@torch.compile(backend='aot_eager')\n"
                                "def step(ids):\n"
                                "    loss = draft(t(ids).logits).logsumexp(-1).mean()\n"
                                "    loss.backward()\n"
                                "    optim.step()\n"
                                "step(torch.tensor([[1, 2, 3]]))\n")
    record_script(compiled, [], tmp_path / "rec")
    recording = read_recording(tmp_path / "rec")
    fed = [e for e in recording.steps[0]["entries"].values() if e["role"] == "drafter_input"]
    assert [e["shape"] for e in fed] == [[1, 3, 512]], recording.steps[0]["entries"]  # the drafter's hook fired
    assert COMPILE_DISABLED in audit_recording(recording).notes
    import torch

    assert torch._dynamo.eval_frame._stance.stance == "default"  # the process's compiler as it was


def test_a_script_failing_before_step_one_shows_its_status_and_last_line(tmp_path, capsys):
    failing = tmp_path / "fail.py"
    failing.write_text("import sys\nsys.stderr.write('cannot open the data shard\\n')\nsys.exit(3)\n")
    assert main(["trace", "--out", str(tmp_path / "o"), "--", sys.executable, str(failing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dflash-audit: error: ") and "status 3" in err and "cannot open the data shard" in err


def test_recordings_of_another_version_or_truncated_and_foreign_outs_are_refused(traced, target_dir, tmp_path,
                                                                                 capsys):
    out = tmp_path / "rec"
    record_script(TRAINER, ["--target", str(target_dir)], out)
    manifest = json.loads((out / MANIFEST).read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / TENSORS).write_bytes((out / TENSORS).read_bytes())
    (other / MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    assert main(["trace", "--from", str(other)]) == 2
    assert "format 99" in capsys.readouterr().err
    # An edited manifest (the tensor file is hashed, the manifest is not): one line naming the field, never a fault
    # further on, and never a tensor file outside the folder.
    step = manifest["steps"][0]
    edits = {"steps": ({**manifest, "steps": "x"}, "steps"), "none": ({**manifest, "steps": []}, "steps"),
             "loss": ({**manifest, "steps": [{**step, "loss": "x"}]}, "steps.0.loss"),
             "entries": ({**manifest, "steps": [{k: v for k, v in step.items() if k != "entries"}]}, "steps.0.entries"),
             "facts": ({**manifest, "steps": [{**step, "drafter": {**step["drafter"], "facts": {
                 **step["drafter"]["facts"], "block_size": "x"}}}]}, "steps.0.drafter.facts.block_size"),
             "ghost": ({**manifest, "steps": [{**step, "entries": {**step["entries"], "ghost": {
                 "role": "tokens", "shape": [1], "dtype": "int64"}}}]}, "'ghost'"),
             "outside": ({**manifest, "tensors_file": "/etc/hostname"}, "tensors_file")}
    for name, (edited, field) in edits.items():
        (other / MANIFEST).write_text(json.dumps(edited))
        assert main(["trace", "--from", str(other)]) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and field in lines[0] and "rerun with --debug" not in lines[0], (name, lines)
    # A tensor file rewritten and its hash updated (a consistent edit): its tensors must still be what the manifest
    # says and what the audit reads (token ids inside the target's vocabulary); a --ref read strictly.
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / TENSORS)
    for name, (value, words) in {"tokens.0": (lambda t: torch.full_like(t, 10**6), "outside the target's vocabulary"),
                                 "fed.1": (lambda t: t[..., :4].contiguous(), "the manifest recorded")}.items():
        save_file({**tensors, f"step0/{name}": value(tensors[f"step0/{name}"])}, other / TENSORS,
                  metadata={"schema": "dflash-audit/trace-recording/1"})
        data = (other / TENSORS).read_bytes()
        shape = list(value(tensors[f"step0/{name}"]).shape)
        entries = {**step["entries"], name: {**step["entries"][name], "shape": shape}} if name == "tokens.0" \
            else step["entries"]
        (other / MANIFEST).write_text(json.dumps({**manifest, "tensors_bytes": len(data),
                                                  "tensors_sha256": hashlib.sha256(data).hexdigest(),
                                                  "steps": [{**step, "entries": entries}]}))
        assert main(["trace", "--from", str(other), "--out", str(tmp_path / "report")]) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and name in lines[0] and words in lines[0], (name, lines)
    for ids in ("1,3", [1, "x"], [-1, 3]):
        (tmp_path / "ref.json").write_text(json.dumps({"target_layer_ids": ids}))
        assert main(["trace", "--from", str(out), "--out", str(tmp_path / "report"), "--ref",
                     str(tmp_path / "ref.json")]) == 2, ids
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "target_layer_ids" in lines[0] and "rerun with --debug" not in lines[0], lines
    data = (out / TENSORS).read_bytes()
    (out / TENSORS).write_bytes(data[: len(data) // 2])
    assert main(["trace", "--from", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "truncated" in err and len(err.splitlines()) == 1
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    assert main(["trace", "--out", str(mine), "--", sys.executable, str(TRAINER)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "the user's" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def findings_of(report):
    return [(f.component, f.key, f.message) for f in report.findings]


def test_steps_zero_lets_the_script_finish_and_every_step_is_audited(target_dir, tmp_path, traced):
    record_script(TRAINER, ["--target", str(target_dir), "--gamma", "7", "--steps", "2"], tmp_path, steps=0)
    recording = read_recording(tmp_path)
    assert len(recording.steps) == 2
    report = audit_recording(recording)
    # The steps' findings are the one step's; the run across the two adds what this trainer's run is (AdamW on
    # every parameter, a constant lr, no clipping), held to speculators' TrainConfig-resolved run (test_trace_run.py).
    run = [(f.component, f.key) for f in report.findings if (f.component, f.key) in RUN_KEYS]
    assert [f for f in findings_of(report) if f[:2] not in run] == findings_of(traced["gamma 7"])
    assert sorted(run) == [("recipe", "grad_clip"), ("recipe", "lr_schedule"), ("recipe", "optimizer")], run


def test_a_drafter_prepared_by_accelerate_is_found_inside_its_wrapper(target_dir, tmp_path, traced):
    record_script(TRAINER, ["--target", str(target_dir), "--fc-drop-last", "--accelerate"], tmp_path)
    report = audit_recording(read_recording(tmp_path))
    assert findings_of(report) == findings_of(traced["fc fed 4 of 5"])


TORCHRUN = Path(sys.executable).with_name("torchrun")


# Held faster in `make test` by test_fsdp2_sharded_drafter_under_torchrun_gives_the_single_process_findings (the same
# launcher, trainer, bug and two steps: rank 0 records, each rank's digest gathered and its own, the single process's
# findings; the drafter sharded besides).
@pytest.mark.full
@pytest.mark.slow
def test_under_torchrun_rank_zero_records_what_a_single_process_does(target_dir, tmp_path, traced, capsys):
    """Two gloo ranks, the drafter in DDP: rank 0 records, and its findings are the single process's."""
    out = tmp_path / "trace"
    assert main(["trace", "--steps", "2", "--out", str(out), "--", str(TORCHRUN), "--standalone", "--nproc-per-node",
                 "2",
                 "--log-dir", str(tmp_path / "logs"),  # torchrun's own folders (else a torchelastic_* in the temp dir)
                 str(TRAINER), "--ddp", "--target", str(target_dir), "--gamma", "7"]) == 1
    capsys.readouterr()
    recording = read_recording(out)
    assert recording.manifest["context"]["world_size"] == 2 and recording.manifest["context"]["rank"] == 0
    # Each rank's step digest is gathered to rank 0 (the run's shard check): the trainer feeds each rank its own batch.
    # (Two steps recorded: the script's trace.step(loss) ends the last one before its optimizer steps.)
    digests = recording.manifest["context"]["run"]["steps"][0]["ranks_embedded"]
    assert len(digests) == 2 and digests[0] != digests[1] and None not in digests
    assert findings_of(audit_recording(recording)) == findings_of(traced["gamma 7"])


@pytest.mark.slow
def test_fsdp2_sharded_drafter_under_torchrun_gives_the_single_process_findings(target_dir, tmp_path, traced,
                                                                                 capsys):
    """Two gloo ranks, the drafter's layers and the drafter sharded by `fully_shard` (FSDP2 DTensors, as speculators
    shards it): the loss's leaves are the gathered copies, mapped back to the sharded parameters, the drafter keeps
    its own class's name; rank 0 records, and its findings are the single process's. Two steps: nothing the recorders
    did on one rank alone put the ranks' collectives out of step; the step parity, which would need the whole weights
    on rank 0, says it is not compared."""
    out = tmp_path / "trace"
    assert main(["trace", "--steps", "2", "--parity", "1", "--out", str(out), "--", str(TORCHRUN), "--standalone",
                 "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(TRAINER), "--fsdp2", "--target",
                 str(target_dir), "--gamma", "7"]) == 1
    capsys.readouterr()
    recording = read_recording(out)
    assert recording.manifest["context"]["world_size"] == 2 and recording.manifest["context"]["rank"] == 0
    assert recording.steps[0]["drafter"]["class"] == "dflash.model:DFlashDraftModel"
    assert findings_of(audit_recording(recording)) == findings_of(traced["gamma 7"])
    # The second step was taken (the recorder issued no collective of its own on one rank alone), and each rank's
    # step digest was gathered: the trainer feeds each rank its own batch.
    digests = recording.manifest["context"]["run"]["steps"][0]["ranks_embedded"]
    assert len(digests) == 2 and digests[0] != digests[1] and None not in digests
    # This run with rank 0's digest on both ranks, as a trainer feeding every rank rank 0's shard records it, is
    # exactly one more finding, the shard's (end to end under DDP: tests/test_trace_run.py, make test-full).
    same = json.loads(json.dumps(recording.manifest))
    for step in same["context"]["run"]["steps"]:
        step["ranks_embedded"] = [step["ranks_embedded"][0]] * 2
    sound, fed_alike = audit_run(recording.manifest), audit_run(same)
    assert "shards" in sound.facts and not any(f.key == "shard" for f in sound.findings)
    added = [f for f in fed_alike.findings if f.key == "shard"]
    kinds = lambda run: sorted((f.component, f.key, f.severity) for f in run.findings)  # noqa: E731
    assert kinds(fed_alike) == sorted(kinds(sound) + [("recipe", "shard", "divergence")])
    assert len(added) == 1 and "ranks 0 and 1 were fed the same batch at step 1" in added[0].message
    run = recording.manifest["context"]["run"]
    unavailable = "the drafter's weights are held in shards across ranks (FSDP2"
    assert run["parity"]["unavailable"].startswith(unavailable) and not (out / PARITY).exists()
    said = RunAudit()
    parity(said, out, run, None, [])  # (one optimizer step recorded: the run's audit stops before its parity)
    assert said.notes == [f"step parity: not compared: {run['parity']['unavailable']}"] and not said.findings


# Run under torchrun by the test below: a model sharded unevenly by `fully_shard` (3 and 1 rows on 2 ranks: rank 1's
# shard of the second layer is empty), read as the recorders read it.
SHARDED_READS = """
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dflash_audit.trace.evaluation.recorder import _fingerprint, _weights
from dflash_audit.trace.record.sharded import nonzero_count, square_sum, whole_sums
from dflash_audit.trace.run.recorder import RunRecorder

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
fully_shard(model[0])
fully_shard(model)
params = list(model.parameters())
whole = [p.full_tensor().detach().double() for p in params]
got = whole_sums(params, (torch.sum, square_sum, nonzero_count))
for w, (total, squares, nonzero) in zip(whole, got):
    assert math.isclose(total, float(w.sum()), rel_tol=1e-12), (total, float(w.sum()))
    assert math.isclose(squares, float(w.square().sum()), rel_tol=1e-12) and nonzero == w.numel()
loss = model(torch.randn(4, 5)).sum()
if rank == 0:  # the evaluation capture's read, on rank 0 alone, between the forward and the backward
    prints = {name: _fingerprint(t) for name, t in _weights(model)}
    assert prints["1.weight"] == [[1, 3], float(whole[2].sum()), float(whole[2].square().sum())], prints
    assert prints["0.weight"] == [[3, 5], None, None], prints  # held in shards: its sums unknown on rank 0
loss.backward()  # had the read resharded the root, rank 0's all-gather would meet rank 1's prefetch of another
norm = RunRecorder._grad_norm(params)
true = math.sqrt(sum(float(p.grad.full_tensor().double().square().sum()) for p in params))
assert math.isclose(norm, true, rel_tol=1e-12), (norm, true)
Path(sys.argv[1], f"ok-{rank}").write_text("ok")  # a file a rank: the ranks' shared stdout interleaves their lines
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_sharded_parameters_are_read_whole_by_every_rank_alike_and_never_by_one_alone(tmp_path):
    """FSDP2's DTensors: the run's sums and gradient norm are the whole parameters' (added across the ranks by
    collectives every rank issues), the evaluation capture's read on rank 0 alone issues none and reshards nothing
    (the backward after it pairs its all-gathers), and a tensor rank 0 holds a shard of has its sums unknown."""
    script = tmp_path / "sharded_reads.py"
    script.write_text(SHARDED_READS)
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]  # every rank's checks ran to the end


ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.mark.slow
def test_under_accelerate_launch_the_findings_are_the_single_process_ones(target_dir, tmp_path, traced, capsys):
    out = tmp_path / "trace"
    assert main(["trace", "--out", str(out), "--", str(ACCELERATE), "launch", "--cpu", "--num_processes", "1",
                 str(TRAINER), "--accelerate", "--target", str(target_dir), "--gamma", "7"]) == 1
    capsys.readouterr()
    assert findings_of(audit_recording(read_recording(out))) == findings_of(traced["gamma 7"])


def test_the_scripts_line_survives_every_trace_module_imported():
    """`trace.step(loss)` and `trace.tau(x)` are the lines a script calls: no module of the package may shadow them
    (a subpackage `trace.step` would, once anything imported it)."""
    import importlib
    import pkgutil

    import dflash_audit.trace as trace

    for module in pkgutil.walk_packages(trace.__path__, "dflash_audit.trace."):
        if not module.name.endswith("sitecustomize"):
            importlib.import_module(module.name)
    assert inspect.isfunction(trace.step) and inspect.isfunction(trace.tau)
