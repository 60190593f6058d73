"""The trainer corpus's padded_batch, packed_documents and precomputed_targets: each runs from the command line, sound
and with all four bugs; and, on the very tensors each script trains on (recorded in-process through its own
functions), each planted bug does what its name says and the sound run is the reference: fc fed the five feature
layers (or the first four), the training targets the target's head over its last layer (or layer 9, or plus noise of
std 0.5) at position a+k-1, the loss the decayed KL with gamma 4 (or 7). The expected values come from the target
itself, computed here independently (forward hooks on its decoder layers, one unpadded sequence or document at a
time)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_world.target_training import distinct_random_qwen3

CORPUS = Path(__file__).parent / "trainer_corpus"
SCRIPTS = ("padded_batch", "packed_documents", "precomputed_targets")
ALL_BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")
FEATURE_IDS = [1, 3, 5, 7, 9]
# In-process runs: the exact bugs together, the noise alone (so its check compares with the clean target).
IN_PROCESS_RUNS = {"sound": (), "exact_bugs": ("fc_4_of_5", "targets_layer_9", "gamma_7"),
                   "noise": ("target_noise_0.5",)}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus-b-target")
    distinct_random_qwen3(12, 64, 512).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", autouse=True)
def cli_runs(target_dir):
    """All six command-line runs, started before the in-process checks so that they overlap them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name in SCRIPTS:
        for label, bugs in (("sound", ()), ("all_bugs", ALL_BUGS)):
            argv = [sys.executable, str(CORPUS / f"{name}.py"), "--target", str(target_dir), "--steps", "2"]
            argv += [arg for bug in bugs for arg in ("--bug", bug)]
            runs[name, label] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                 env=env)
    yield runs
    for process in runs.values():
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.mark.parametrize("label", ["sound", "all_bugs"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_script_runs_from_the_command_line(cli_runs, name, label):
    out, err = cli_runs[name, label].communicate(timeout=300)
    assert cli_runs[name, label].returncode == 0, err[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out, flags=re.M)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out


# ------------------------------------------------------------------ the independent computation

def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"trainer_corpus_{name}", CORPUS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def raw_layer_outputs(target: Qwen3ForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """[n_layers, T, H]: each decoder layer's own output for one unpadded sequence, through forward hooks."""
    kept = {}

    def keeper(index):
        def keep(_module, _args, out):
            kept[index] = out[0] if isinstance(out, tuple) else out
        return keep

    handles = [layer.register_forward_hook(keeper(i)) for i, layer in enumerate(target.model.layers)]
    try:
        target.model(input_ids=token_ids[None])
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([kept[i][0] for i in range(len(target.model.layers))])


@torch.no_grad()
def head_over(target: Qwen3ForCausalLM, raw: torch.Tensor) -> torch.Tensor:
    return target.lm_head(target.model.norm(raw))


def reference_loss(draft, teacher, slot, seq, valid, gamma: float) -> float:
    """KL(teacher || draft) per slot, weight 0 at slot 0 and exp(-(k-1)/gamma) after, per sequence
    sum(w*mask*kl)/(sum(mask)+1e-5), then the mean over sequences."""
    log_p, log_q = teacher.double().log_softmax(-1), draft.double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    weight = torch.where(slot == 0, 0.0, torch.exp(-(slot.double() - 1) / gamma))
    mask = (valid & (slot > 0)).double()
    per_seq = [(weight * mask * kl)[seq == s].sum() / (mask[seq == s].sum() + 1e-5) for s in seq.unique()]
    return torch.stack(per_seq).mean().item()


@dataclass
class Observed:
    """What one training step of a script really used, with the rows the expectations are computed over."""
    fc_in_features: int
    fed_features: torch.Tensor  # [R, T, n*H] what fc was given
    raw: torch.Tensor  # [n_layers, R, T, H] the independent layer outputs at the same rows and positions
    feature_valid: torch.Tensor  # [R, T] positions that hold real tokens
    draft: torch.Tensor  # [S, V] drafter logits per block slot
    teacher: torch.Tensor  # [S, V] the training target per block slot
    slot: torch.Tensor  # [S] index k in the block
    row: torch.Tensor  # [S] the row of `raw` the slot's block lies in
    source: torch.Tensor  # [S] position a+k-1 the slot's target should come from (slot 0: unused)
    seq: torch.Tensor  # [S] which sequence the slot's loss is averaged in
    valid: torch.Tensor  # [S] slot may carry loss
    loss: float


def record(monkeypatch, owner, attr, log: list, *, keep_args=True):
    original = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        log.append((args, kwargs, out) if keep_args else out)
        return out

    monkeypatch.setattr(owner, attr, wrapper)


def run_main(module, monkeypatch, target_dir: Path, bugs) -> None:
    argv = [module.__file__, "--target", str(target_dir), "--steps", "1"]
    monkeypatch.setattr(sys, "argv", argv + [a for bug in bugs for a in ("--bug", bug)])
    module.main()


def observe_padded_batch(module, monkeypatch, target_dir, target, bugs) -> list[Observed]:
    ran_target, fused, losses = [], [], []
    record(monkeypatch, module, "run_target", ran_target)
    record(monkeypatch, module.BlockDrafter, "fuse", fused)
    record(monkeypatch, module, "block_kl_loss", losses)
    run_main(module, monkeypatch, target_dir, bugs)
    (_, input_ids, attention_mask, *_), _, _ = ran_target[0]
    (drafter, features), _, _ = fused[0]
    (draft_logits, target_logits, positions, _slot_mask, _gamma), _, loss = losses[0]
    rows, width = input_ids.shape
    lengths = attention_mask.sum(1)
    raw = torch.zeros(len(target.model.layers), rows, width, target.config.hidden_size)
    for r in range(rows):
        raw[:, r, : lengths[r]] = raw_layer_outputs(target, input_ids[r, : lengths[r]])
    anchors = positions[:, :, 0]
    assert ((anchors >= 0) & (anchors < lengths[:, None] - positions.shape[2])).all()  # real tokens, not the last B
    b, n, blk = positions.shape
    slot = torch.arange(blk).expand(b, n, blk).flatten()
    row = torch.arange(b)[:, None, None].expand(b, n, blk).flatten()
    source = (positions - 1).clamp(min=0).flatten()
    return [Observed(
        fc_in_features=drafter.feature_fuser.in_features, fed_features=features, raw=raw,
        feature_valid=attention_mask.bool(), draft=draft_logits.detach().reshape(b * n * blk, -1),
        teacher=target_logits[row, source], slot=slot, row=row, source=source, seq=row,
        valid=attention_mask[row, positions.flatten()].bool(), loss=loss.item())]


def observe_packed_documents(module, monkeypatch, target_dir, target, bugs) -> list[Observed]:
    drafted, teachers, losses = [], [], []
    record(monkeypatch, module.PackedDrafter, "forward", drafted)
    record(monkeypatch, module.TeacherBlockLoss, "teacher_logits", teachers)
    record(monkeypatch, module.TeacherBlockLoss, "forward", losses)
    run_main(module, monkeypatch, target_dir, bugs)
    (drafter, input_ids, _position_ids, document_ids, features, anchors), _, draft_logits = drafted[0]
    teacher, loss = teachers[0][2], losses[0][2]
    docs = document_ids[0]
    raw = torch.cat([raw_layer_outputs(target, input_ids[0, docs == d]) for d in docs.unique()], dim=1)[:, None]
    blk = teacher.shape[1]
    ends = anchors + blk
    assert (ends < docs.numel()).all() and (docs[ends] == docs[anchors]).all()  # not in a document's last B tokens
    slot = torch.arange(blk).repeat(len(anchors))
    source = (anchors[:, None] + torch.arange(blk) - 1).clamp(min=0).flatten()
    zeros = torch.zeros_like(slot)
    return [Observed(
        fc_in_features=drafter.dflash.fc.in_features, fed_features=features, raw=raw,
        feature_valid=torch.ones(1, docs.numel(), dtype=torch.bool), draft=draft_logits.detach()[0],
        teacher=teacher.reshape(len(slot), -1), slot=slot, row=zeros, source=source, seq=zeros,
        valid=torch.ones_like(slot, dtype=torch.bool), loss=loss.item())]


def observe_precomputed_targets(module, monkeypatch, target_dir, target, bugs) -> list[Observed]:
    batches, drafted, losses = [], [], []
    record(monkeypatch, module.TeacherFile, "next_micro_batch", batches)
    record(monkeypatch, module.Drafter, "forward", drafted)
    record(monkeypatch, module, "distill_loss", losses)
    from accelerate.state import AcceleratorState, GradientState

    def reset_accelerate():  # the process-wide state an Accelerator sets up: none before the run, none left after
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset_accelerate()
    try:
        run_main(module, monkeypatch, target_dir, bugs)
    finally:
        reset_accelerate()
    assert len(losses) == 2  # two micro-batches make the one optimizer step
    observed = []
    for (_, _, (input_ids, _, _)), ((drafter, _, _, features, _), _, _), loss_call in zip(batches, drafted, losses):
        (draft_logits, teacher_logits, positions, _gamma), _, loss = loss_call
        raw = torch.stack([raw_layer_outputs(target, ids) for ids in input_ids], dim=1)
        b, n, blk = positions.shape
        assert ((positions[:, :, 0] >= 0) & (positions[:, :, 0] < input_ids.shape[1] - blk)).all()
        slot = torch.arange(blk).expand(b, n, blk).flatten()
        row = torch.arange(b)[:, None, None].expand(b, n, blk).flatten()
        source = (positions - 1).clamp(min=0).flatten()
        observed.append(Observed(
            fc_in_features=drafter.fuse.in_features, fed_features=features, raw=raw,
            feature_valid=torch.ones(input_ids.shape, dtype=torch.bool),
            draft=draft_logits.detach().reshape(b * n * blk, -1), teacher=teacher_logits[row, source], slot=slot,
            row=row, source=source, seq=row, valid=torch.ones_like(slot, dtype=torch.bool), loss=loss.item()))
    return observed


OBSERVERS = {"padded_batch": observe_padded_batch, "packed_documents": observe_packed_documents,
             "precomputed_targets": observe_precomputed_targets}


@pytest.mark.parametrize("run", list(IN_PROCESS_RUNS))
@pytest.mark.parametrize("name", SCRIPTS)
def test_each_bug_does_what_its_name_says(name, run, target_dir, monkeypatch):
    bugs = set(IN_PROCESS_RUNS[run])
    target = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    hidden, last = target.config.hidden_size, target.config.num_hidden_layers - 1
    for seen in OBSERVERS[name](load_script(name), monkeypatch, target_dir, target, bugs):
        # fc: the first four feature layers under fc_4_of_5, all five otherwise, each the output of decoder layer id
        fed_ids = FEATURE_IDS[:4] if "fc_4_of_5" in bugs else FEATURE_IDS
        assert seen.fc_in_features == len(fed_ids) * hidden
        expected = torch.cat([seen.raw[i] for i in fed_ids], dim=-1)
        torch.testing.assert_close(seen.fed_features[seen.feature_valid], expected[seen.feature_valid],
                                   atol=2e-4, rtol=1e-4)

        # targets: the head over decoder layer 9 or the last layer, at position a+k-1, plus noise of std 0.5 or none
        scored = seen.valid & (seen.slot > 0)
        teacher_layer = 9 if "targets_layer_9" in bugs else last
        clean = head_over(target, seen.raw[teacher_layer][seen.row, seen.source])
        offset = seen.teacher[scored] - clean[scored]
        if "target_noise_0.5" in bugs:
            assert abs(offset.mean().item()) < 0.02 and abs(offset.std().item() - 0.5) < 0.02
        else:
            torch.testing.assert_close(offset, torch.zeros_like(offset), atol=2e-3, rtol=0)
        if "targets_layer_9" in bugs:  # and not the last layer's: it differs by far more than the tolerance above
            from_last = head_over(target, seen.raw[last][seen.row, seen.source])[scored]
            assert (seen.teacher[scored] - from_last).abs().max() > 0.05

        # loss: the decayed KL with the gamma the bug names, and not the other one
        gamma, other = (7.0, 4.0) if "gamma_7" in bugs else (4.0, 7.0)
        args = (seen.draft, seen.teacher, seen.slot, seen.seq, seen.valid)
        assert seen.loss == pytest.approx(reference_loss(*args, gamma), rel=1e-5)
        assert seen.loss != pytest.approx(reference_loss(*args, other), rel=1e-3)
