"""The trainer corpus (tests/trainer_corpus/): each team's script runs, and each planted bug is what its name says.

Every script runs as its own `__main__` (sound and with all four bugs, 2 steps) and must exit 0 printing finite
losses.
Then each script is imported and its own pieces are held by value to an independent computation made here: the
target's layer outputs taken with forward hooks (not `output_hidden_states`), the target's next-token logits as
lm_head(final_norm(raw output of the last decoder layer)) read at position p - 1 for a slot at position p, the
drafter's logits block by block in z-lab's inference-style call (the in-house drafter's weights loaded into
z-lab's DFlashDraftModel), and DFlash's decayed loss written out afresh. padded_batch, packed_documents,
precomputed_targets, own_modulelist_no_config and offline_hidden_states_file are held so on one real training step
each, recorded through their own functions.
"""

from __future__ import annotations

import importlib.util
import math
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_world.target_training import distinct_random_qwen3

CORPUS = Path(__file__).resolve().parent / "trainer_corpus"
SCRIPTS = ("zlab_blocks_one_call", "zlab_per_anchor", "own_drafter_targets_inside",
           "padded_batch", "packed_documents", "precomputed_targets", "own_modulelist_no_config",
           "offline_hidden_states_file", "hf_trainer_grad_accum", "accelerate_bf16_autocast",
           "moduledict_left_padded", "checkpointed_list_features", "functional_call_ema")
BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")
LAYERS = (1, 3, 5, 7, 9)
HIDDEN, VOCAB, TARGET_LAYERS = 64, 512, 12
LOSS_LINE = re.compile(r"loss\S*?[=:\s]\s*(\S+)")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus_target")
    distinct_random_qwen3(TARGET_LAYERS, HIDDEN, VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"trainer_corpus_{name}", CORPUS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is being executed
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the independent side


@torch.no_grad()
def layer_outputs(target, input_ids) -> dict[int, torch.Tensor]:
    """Raw output of every decoder layer, taken with forward hooks."""
    outputs, handles = {}, []
    for i, layer in enumerate(target.model.layers):
        handles.append(layer.register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)))
    try:
        target(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def next_token_logits(target, raw_layer_output):
    """The target's logits from one layer's raw output: final norm, then the LM head."""
    with torch.no_grad():
        return target.lm_head(target.model.norm(raw_layer_output))


def features(outputs, layers):
    return torch.cat([outputs[i] for i in layers], dim=-1)


def zlab_block_logits(drafter, target, input_ids, context, anchors, block, mask_id):
    """[R, A, B, V]: each block drafted alone, z-lab's inference-style call (context < anchor, positions 0..a+B-1)."""
    rows = []
    for r in range(input_ids.shape[0]):
        per_anchor = []
        for a in anchors[r].tolist():
            ids = torch.full((1, block), mask_id, dtype=torch.long)
            ids[0, 0] = input_ids[r, a]
            out = drafter(target_hidden=context[r : r + 1, :a], noise_embedding=target.model.embed_tokens(ids),
                          position_ids=torch.arange(a + block)[None])
            per_anchor.append(target.lm_head(out)[0])
        rows.append(torch.stack(per_anchor))
    return torch.stack(rows)


def dflash_loss(draft_logits, teacher_logits, anchors, gamma, kind):
    """Slot k >= 1 of the block at anchor a learns the teacher at position a + k - 1, weight exp(-(k-1)/gamma);
    per row sum(w * loss) / (number of trained slots + 1e-5), then the mean over rows."""
    rows, n_anchors, block, _ = draft_logits.shape
    per_row = []
    for r in range(rows):
        total = 0.0
        for j in range(n_anchors):
            a = int(anchors[r, j])
            for k in range(1, block):
                teacher, draft = teacher_logits[r, a + k - 1], draft_logits[r, j, k]
                if kind == "kl":
                    p = teacher.softmax(-1)
                    term = (p * (p.log() - draft.log_softmax(-1))).sum()
                else:
                    term = F.cross_entropy(draft, teacher.argmax())
                total = total + math.exp(-(k - 1) / gamma) * term
        per_row.append(total / (n_anchors * (block - 1) + 1e-5))
    return torch.stack(per_row).mean()


def replayed_noise(generator_state, shape):
    generator = torch.Generator()
    generator.set_state(generator_state)
    return 0.5 * torch.randn(shape, generator=generator)


def batch(rows=2, seq_len=40, anchors=((0, 9, 30), (4, 17, 25)), low=0):
    input_ids = torch.randint(low, VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(7))
    return input_ids, torch.tensor(anchors)


def close(a, b):
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ every script runs


@pytest.mark.parametrize("bugs", [(), BUGS], ids=["sound", "seed-bugs"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_runs_sound_and_with_all_bugs(name, bugs, target_dir, monkeypatch, capsys):
    """Each script run as its own `__main__` with its command line, in this process: a child process would add
    only the interpreter's start-up (about 7 s of imports each; tests/test_trace_corpus.py runs one as a child)."""
    argv = [str(CORPUS / f"{name}.py"), "--target", str(target_dir), "--steps", "2",
            *[arg for bug in bugs for arg in ("--bug", bug)]]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (None, 0), f"{name} {bugs}: exit {exc.code}"
    out = capsys.readouterr().out
    losses = [float(value) for value in LOSS_LINE.findall(out)]
    assert len(losses) == 2, f"{name} {bugs}: expected a loss per step in\n{out}"
    assert all(math.isfinite(loss) for loss in losses), f"{name} {bugs}: {losses}"


# ------------------------------------------------------------------ zlab_blocks_one_call


def test_blocks_one_call_is_sound_by_value(target):
    m = load_script("zlab_blocks_one_call")
    input_ids, anchors = batch()
    drafter = m.build_drafter(target.config, set())
    assert drafter.fc.in_features == 5 * HIDDEN
    outputs = layer_outputs(target, input_ids)
    context, teacher = m.run_target(target, input_ids, set(), torch.Generator())
    assert close(context, features(outputs, LAYERS))
    assert close(teacher, next_token_logits(target, outputs[TARGET_LAYERS - 1]))
    # the one-call mask and positions draft each block exactly as z-lab's own per-block call does
    with torch.no_grad():
        loss = m.train_step(drafter, target, input_ids, anchors, set(), torch.Generator())
        draft = zlab_block_logits(drafter, target, input_ids, context, anchors, m.BLOCK, drafter.mask_token_id)
    assert close(loss, dflash_loss(draft, teacher, anchors, 4.0, "kl"))


def test_blocks_one_call_bugs_by_value(target):
    m = load_script("zlab_blocks_one_call")
    input_ids, anchors = batch()
    outputs = layer_outputs(target, input_ids)
    last = next_token_logits(target, outputs[TARGET_LAYERS - 1])

    drafter = m.build_drafter(target.config, {"fc_4_of_5"})
    assert drafter.fc.in_features == 4 * HIDDEN
    context, teacher = m.run_target(target, input_ids, {"fc_4_of_5"}, torch.Generator())
    assert close(context, features(outputs, LAYERS[:4])) and close(teacher, last)

    _, teacher9 = m.run_target(target, input_ids, {"targets_layer_9"}, torch.Generator())
    assert close(teacher9, next_token_logits(target, outputs[9])) and not close(teacher9, last)

    state = torch.Generator().manual_seed(3).get_state()
    generator = torch.Generator()
    generator.set_state(state)
    _, noisy = m.run_target(target, input_ids, {"target_noise_0.5"}, generator)
    assert close(noisy, last + replayed_noise(state, last.shape))
    assert abs((noisy - last).std().item() - 0.5) < 0.01

    drafter = m.build_drafter(target.config, set())
    with torch.no_grad():
        loss7 = m.train_step(drafter, target, input_ids, anchors, {"gamma_7"}, torch.Generator())
        draft = zlab_block_logits(drafter, target, input_ids, features(outputs, LAYERS), anchors, m.BLOCK,
                                  drafter.mask_token_id)
    assert close(loss7, dflash_loss(draft, last, anchors, 7.0, "kl"))
    assert not close(loss7, dflash_loss(draft, last, anchors, 4.0, "kl"))


# ------------------------------------------------------------------ zlab_per_anchor


def test_per_anchor_is_sound_and_bugs_by_value(target, target_dir):
    m = load_script("zlab_per_anchor")
    input_ids, _ = batch()
    step_anchors = [0, 9, 30, 35]
    anchors = torch.tensor([step_anchors, step_anchors])
    outputs = layer_outputs(target, input_ids)
    last = next_token_logits(target, outputs[TARGET_LAYERS - 1])
    ce = torch.nn.CrossEntropyLoss(reduction="none")

    def script_loss(recipe, drafter, ctx, labels):
        with torch.no_grad():
            return sum(m.anchor_loss(drafter, target, input_ids, ctx, labels, a, recipe, ce)
                       for a in step_anchors) / len(step_anchors)

    sound = m.recipe_with([])
    drafter = m.make_drafter(str(target_dir), sound)
    assert drafter.fc.in_features == 5 * HIDDEN
    ctx, labels = m.TargetSide(target, sound)(input_ids)
    assert close(ctx, features(outputs, LAYERS))
    assert torch.equal(labels, last.argmax(-1))
    with torch.no_grad():
        draft = zlab_block_logits(drafter, target, input_ids, ctx, anchors, sound.block_size, sound.mask_token_id)
    assert close(script_loss(sound, drafter, ctx, labels), dflash_loss(draft, last, anchors, 4.0, "ce"))

    fc4 = m.recipe_with(["fc_4_of_5"])
    assert m.make_drafter(str(target_dir), fc4).fc.in_features == 4 * HIDDEN
    ctx4, labels4 = m.TargetSide(target, fc4)(input_ids)
    assert close(ctx4, features(outputs, LAYERS[:4])) and torch.equal(labels4, labels)

    _, labels9 = m.TargetSide(target, m.recipe_with(["targets_layer_9"]))(input_ids)
    at9 = next_token_logits(target, outputs[9]).argmax(-1)
    assert torch.equal(labels9, at9) and not torch.equal(labels9, labels)

    noisy_side = m.TargetSide(target, m.recipe_with(["target_noise_0.5"]))
    state = noisy_side.noise.get_state()
    _, noisy_labels = noisy_side(input_ids)
    assert torch.equal(noisy_labels, (last + replayed_noise(state, last.shape)).argmax(-1))
    assert not torch.equal(noisy_labels, labels)

    gamma7 = m.recipe_with(["gamma_7"])
    loss7 = script_loss(gamma7, drafter, ctx, labels)
    assert close(loss7, dflash_loss(draft, last, anchors, 7.0, "ce"))
    assert not close(loss7, dflash_loss(draft, last, anchors, 4.0, "ce"))


# ------------------------------------------------------------------ own_drafter_targets_inside


ZLAB_NAMES = {"context_proj": "fc", "context_norm": "hidden_norm", "final_norm": "norm", "blocks": "layers",
              "attn_norm": "input_layernorm", "attn": "self_attn", "wq": "q_proj", "wk": "k_proj", "wv": "v_proj",
              "wo": "o_proj", "mlp_norm": "post_attention_layernorm", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}


def as_zlab_drafter(own, target_config, block, mask_id):
    """z-lab's DFlashDraftModel holding the team's weights (renamed): an independent forward of the same drafter."""
    weights = {".".join(ZLAB_NAMES.get(part, part) for part in name.split(".")): tensor
               for name, tensor in own.state_dict().items() if name.split(".")[0] in ZLAB_NAMES}
    n_features = own.context_proj.in_features // target_config.hidden_size
    return zlab_drafter_holding(weights, target_config, len(own.blocks), n_features, block, mask_id)


def zlab_drafter_holding(weights, target_config, n_layers, n_features, block, mask_id):
    """z-lab's DFlashDraftModel for this target with the given weights (z-lab's names) and nothing else missing."""
    import copy

    from dflash.model import DFlashDraftModel

    config = copy.deepcopy(target_config)
    config.num_target_layers = target_config.num_hidden_layers
    config.num_hidden_layers = n_layers
    config.layer_types = ["full_attention"] * n_layers
    config.dflash_config = {"target_layer_ids": list(LAYERS[:n_features]), "block_size": block,
                            "mask_token_id": mask_id}
    zlab = DFlashDraftModel(config)
    missing, unexpected = zlab.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary_emb" in name for name in missing), (missing, unexpected)
    return zlab.eval()


def test_own_drafter_is_sound_and_bugs_by_value(target, target_dir):
    m = load_script("own_drafter_targets_inside")
    input_ids, anchors = batch(low=1)
    outputs = layer_outputs(target, input_ids)
    last = next_token_logits(target, outputs[TARGET_LAYERS - 1])
    slot_positions = (anchors[..., None] + torch.arange(m.BLOCK)).flatten(1)

    def step(bugs):
        verifier, taps, drafter, teacher_layer = m.setup(str(target_dir), bugs)
        n_features = drafter.context_proj.in_features // HIDDEN
        feats, verifier_hidden = m.tap_inputs(verifier, taps, input_ids, n_features, teacher_layer)
        state = drafter.noise_rng.get_state()
        with torch.no_grad():
            loss, logits, targets = drafter(input_ids, feats, verifier_hidden, anchors)
            zlab = as_zlab_drafter(drafter, target.config, m.BLOCK, m.MASK_ID)
            blocks = zlab_block_logits(zlab, target, input_ids, feats, anchors, m.BLOCK, m.MASK_ID)
        # all blocks in one forward under the team's mask == z-lab's drafter run on each block alone
        assert close(logits.view(blocks.shape), blocks)
        return drafter, feats, verifier_hidden, state, loss, blocks, targets

    def at_slots(logits):
        """The teacher logits a slot at position p trains toward: those at p - 1 (slot 0's are unused)."""
        return logits.gather(1, (slot_positions - 1).clamp(min=0)[..., None].expand(-1, -1, VOCAB))

    trained = torch.arange(slot_positions.shape[1]) % m.BLOCK != 0

    drafter, feats, verifier_hidden, _, loss, blocks, targets = step(set())
    assert drafter.context_proj.in_features == 5 * HIDDEN
    assert close(feats, features(outputs, LAYERS)) and close(verifier_hidden, outputs[TARGET_LAYERS - 1])
    assert close(targets[:, trained], at_slots(last)[:, trained])
    assert close(loss, dflash_loss(blocks, last, anchors, 4.0, "kl"))

    drafter, feats, *_ = step({"fc_4_of_5"})
    assert drafter.context_proj.in_features == 4 * HIDDEN
    assert close(feats, features(outputs, LAYERS[:4]))

    *_, loss9, blocks9, targets9 = step({"targets_layer_9"})
    assert close(targets9[:, trained], at_slots(next_token_logits(target, outputs[9]))[:, trained])
    assert not close(targets9[:, trained], at_slots(last)[:, trained])

    *_, state, _, _, noisy = step({"target_noise_0.5"})
    assert close(noisy[:, trained], at_slots(last + replayed_noise(state, last.shape))[:, trained])
    assert abs((noisy - at_slots(last))[:, trained].std().item() - 0.5) < 0.02

    *_, loss7, blocks7, _ = step({"gamma_7"})
    assert close(loss7, dflash_loss(blocks7, last, anchors, 7.0, "kl"))
    assert not close(loss7, dflash_loss(blocks7, last, anchors, 4.0, "kl"))


# ------------------------------------------------------------------ the trainers held on one recorded step
# These are held to the reference on one real training step each (`main()` in-process, `--steps 1`): their own
# functions are wrapped to record what the step used (the drafter's inputs, its weights then, its logits, the training
# targets, the loss), and every recorded value is recomputed here from the target and z-lab's drafter.

# The exact bugs together, the noise alone (so that its check compares with the clean targets).
RECORDED_RUNS = {"sound": (), "exact_bugs": ("fc_4_of_5", "targets_layer_9", "gamma_7"),
                 "noise": ("target_noise_0.5",)}


@dataclass
class RecordedStep:
    """One training step of a script as it really ran, with the rows the expectations are computed over."""
    fc_in_features: int
    fed_features: torch.Tensor  # [R, T, n*H] what fc was given
    raw: dict  # decoder layer -> [R, T, H], its raw output over the same rows and positions, computed here
    real: torch.Tensor  # [R, T] positions holding real tokens (not padding)
    draft: torch.Tensor  # [S, V] the drafter's logits per block slot
    zlab_draft: torch.Tensor  # [S, V] z-lab's drafter with the same weights, each block drafted alone
    teacher: torch.Tensor  # [S, V] the training target per block slot
    slot: torch.Tensor  # [S] index k in the block
    row: torch.Tensor  # [S] the row of `raw` the slot's block lies in
    source: torch.Tensor  # [S] position a+k-1 the slot's target should come from (slot 0: unused)
    valid: torch.Tensor  # [S] slot may carry loss
    loss: float


def record_calls(monkeypatch, owner, attr, log: list, weights_of_self=False):
    """Wrap owner.attr; each call appends (args, output), plus a copy of the module's weights at that moment."""
    original = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        assert not kwargs
        weights = {k: v.detach().clone() for k, v in args[0].state_dict().items()} if weights_of_self else None
        out = original(*args)
        log.append((args, out, weights) if weights_of_self else (args, out))
        return out

    monkeypatch.setattr(owner, attr, wrapper)


def run_one_step(module, monkeypatch, target_dir, bugs) -> None:
    argv = [module.__file__, "--target", str(target_dir), "--steps", "1"]
    monkeypatch.setattr(sys, "argv", argv + [arg for bug in bugs for arg in ("--bug", bug)])
    module.main()


def renamed(weights: dict, renames: dict, dropped: tuple) -> dict:
    """A state dict in z-lab's names: prefixes renamed, the target's borrowed tensors dropped."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith(dropped):
            continue
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = tensor
    return out


def block_slots(positions):
    """Slot index, row and target source position (a+k-1) of every slot of [R, n, B] block positions."""
    rows, n, block = positions.shape
    slot = torch.arange(block).expand(rows, n, block).flatten()
    row = torch.arange(rows)[:, None, None].expand(rows, n, block).flatten()
    return slot, row, (positions - 1).clamp(min=0).flatten()


def recorded_padded_batch(module, monkeypatch, target_dir, target, bugs) -> list[RecordedStep]:
    ran_target, drafted, losses = [], [], []
    record_calls(monkeypatch, module, "run_target", ran_target)
    record_calls(monkeypatch, module.DraftNet, "forward", drafted, weights_of_self=True)
    record_calls(monkeypatch, module, "block_kl_loss", losses)
    run_one_step(module, monkeypatch, target_dir, bugs)
    (_, input_ids, attention_mask, *_), _ = ran_target[0]
    (drafter, block_ids, _, features, _, _), draft_logits, weights = drafted[0]
    (_, target_logits, positions, _, _), loss = losses[0]
    rows, width = input_ids.shape
    lengths = attention_mask.sum(1)
    raw = {i: torch.zeros(rows, width, HIDDEN) for i in range(TARGET_LAYERS)}
    for r in range(rows):  # each sequence alone, unpadded
        for i, out in layer_outputs(target, input_ids[r : r + 1, : lengths[r]]).items():
            raw[i][r, : lengths[r]] = out[0]
    anchors = positions[:, :, 0]
    assert ((anchors >= 0) & (anchors < lengths[:, None] - positions.shape[2])).all()  # real tokens, not the last B
    zlab = zlab_drafter_holding(renamed(weights, {"feature_fuser.": "fc.", "feature_norm.": "hidden_norm."},
                                        ("embed.", "head.", "rope.")),
                                target.config, len(drafter.layers), drafter.n_feature_layers, positions.shape[2],
                                int(block_ids[0, 1]))
    with torch.no_grad():
        zlab_draft = torch.cat([zlab_block_logits(zlab, target, input_ids[r : r + 1], features[r : r + 1],
                                                  anchors[r : r + 1], positions.shape[2], int(block_ids[0, 1]))
                                for r in range(rows)])
    slot, row, source = block_slots(positions)
    return [RecordedStep(
        fc_in_features=drafter.feature_fuser.in_features, fed_features=features, raw=raw,
        real=attention_mask.bool(), draft=draft_logits.detach().flatten(0, 1), zlab_draft=zlab_draft.flatten(0, 2),
        teacher=target_logits[row, source], slot=slot, row=row, source=source,
        valid=attention_mask[row, positions.flatten()].bool(), loss=loss.item())]


def recorded_packed_documents(module, monkeypatch, target_dir, target, bugs) -> list[RecordedStep]:
    drafted, teachers, losses = [], [], []
    record_calls(monkeypatch, module.PackedDrafter, "forward", drafted, weights_of_self=True)
    record_calls(monkeypatch, module.TeacherBlockLoss, "teacher_logits", teachers)
    record_calls(monkeypatch, module.TeacherBlockLoss, "forward", losses)
    run_one_step(module, monkeypatch, target_dir, bugs)
    (drafter, input_ids, _, document_ids, features, anchors), draft_logits, weights = drafted[0]
    (teacher, loss) = teachers[0][1], losses[0][1]
    docs, block = document_ids[0], teacher.shape[1]
    starts = {int(d): int((docs == d).nonzero()[0]) for d in docs.unique()}
    per_doc = [layer_outputs(target, input_ids[:, docs == d]) for d in docs.unique()]  # each document alone
    raw = {i: torch.cat([outputs[i] for outputs in per_doc], dim=1) for i in range(TARGET_LAYERS)}
    ends = anchors + block
    assert (ends < docs.numel()).all() and (docs[ends] == docs[anchors]).all()  # not in a document's last B tokens
    dflash = drafter.dflash
    zlab = zlab_drafter_holding(
        renamed(weights, {"dflash.": ""}, ("dflash.embed_tokens.", "dflash.lm_head.", "dflash.verifier_",
                                          "dflash.rotary_emb.")),
        target.config, len(dflash.layers), dflash.fc.in_features // HIDDEN, block, dflash.mask_token_id)
    zlab_draft = torch.zeros(len(anchors), block, VOCAB)
    with torch.no_grad():  # each block drafted alone within its own document, positions from the document's start
        for d, start in starts.items():
            here = docs[anchors] == d
            if not here.any():
                continue
            zlab_draft[here] = zlab_block_logits(zlab, target, input_ids[:, docs == d], features[:, docs == d],
                                                 (anchors[here] - start)[None], block, dflash.mask_token_id)[0]
    slot, row, source = block_slots(anchors[None, :, None] + torch.arange(block))
    return [RecordedStep(
        fc_in_features=dflash.fc.in_features, fed_features=features, raw=raw,
        real=torch.ones(1, docs.numel(), dtype=torch.bool), draft=draft_logits.detach()[0],
        zlab_draft=zlab_draft.flatten(0, 1), teacher=teacher.flatten(0, 1), slot=slot, row=row, source=source,
        valid=torch.ones_like(slot, dtype=torch.bool), loss=loss.item())]


def recorded_precomputed_targets(module, monkeypatch, target_dir, target, bugs) -> list[RecordedStep]:
    from accelerate.state import AcceleratorState, GradientState

    batches, drafted, losses = [], [], []
    record_calls(monkeypatch, module.TeacherFile, "next_micro_batch", batches)
    record_calls(monkeypatch, module.Drafter, "forward", drafted, weights_of_self=True)
    record_calls(monkeypatch, module, "distill_loss", losses)

    def reset_accelerate():  # the process-wide state an Accelerator sets up: none before the run, none left after
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset_accelerate()
    try:
        run_one_step(module, monkeypatch, target_dir, bugs)
    finally:
        reset_accelerate()
    assert len(losses) == 2  # two micro-batches make the one optimizer step
    steps = []
    for (_, (input_ids, _, _)), ((drafter, tokens, _, features, _), draft_logits, weights), loss_call in zip(
            batches, drafted, losses):
        (_, teacher_logits, positions, _), loss = loss_call
        rows, _, block = positions.shape
        per_row = [layer_outputs(target, input_ids[r : r + 1]) for r in range(rows)]
        raw = {i: torch.cat([outputs[i] for outputs in per_row]) for i in range(TARGET_LAYERS)}
        anchors = positions[:, :, 0]
        assert ((anchors >= 0) & (anchors < input_ids.shape[1] - block)).all()
        renames = {"fuse.": "fc.", "fuse_norm.": "hidden_norm.", "out_norm.": "norm.",
                   "block.attn_norm.": "layers.0.input_layernorm.", "block.mlp_norm.": "layers.0.post_attention_layernorm.",
                   **{f"block.{ours}.": f"layers.0.self_attn.{theirs}." for ours, theirs in
                      (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"), ("q_norm", "q_norm"),
                       ("k_norm", "k_norm"))},
                   **{f"block.{ours}.": f"layers.0.mlp.{ours}_proj." for ours in ("gate", "up", "down")}}
        zlab = zlab_drafter_holding(renamed(weights, renames, ("embed.", "head.")), target.config, 1,
                                    drafter.fuse.in_features // HIDDEN, block, int(tokens[0, 1]))
        with torch.no_grad():
            zlab_draft = zlab_block_logits(zlab, target, input_ids, features, anchors, block, int(tokens[0, 1]))
        slot, row, source = block_slots(positions)
        steps.append(RecordedStep(
            fc_in_features=drafter.fuse.in_features, fed_features=features, raw=raw,
            real=torch.ones(input_ids.shape, dtype=torch.bool), draft=draft_logits.detach().flatten(0, 1),
            zlab_draft=zlab_draft.flatten(0, 2), teacher=teacher_logits[row, source], slot=slot, row=row,
            source=source, valid=torch.ones_like(slot, dtype=torch.bool), loss=loss.item()))
    return steps


def recorded_own_modulelist_no_config(module, monkeypatch, target_dir, target, bugs) -> list[RecordedStep]:
    read, drafted, losses = [], [], []
    record_calls(monkeypatch, module, "read_target", read)
    record_calls(monkeypatch, module.TapDrafter, "forward", drafted, weights_of_self=True)
    record_calls(monkeypatch, module, "block_loss", losses)
    run_one_step(module, monkeypatch, target_dir, bugs)
    (_, (tapped, teacher_logits)) = read[0]
    (drafter, *_), hidden, weights = drafted[0]
    (_, _, input_ids, anchors, _, _, _, mask_id), loss = losses[0]
    renames = {"tap_proj.": "fc.", "tap_norm.": "hidden_norm.", "out_norm.": "norm."}
    for i in range(len(drafter.decoder)):
        renames |= {f"decoder.{i}.pre_attn.": f"layers.{i}.input_layernorm.",
                    f"decoder.{i}.pre_ffn.": f"layers.{i}.post_attention_layernorm.",
                    **{f"decoder.{i}.attn.{ours}.": f"layers.{i}.self_attn.{theirs}." for ours, theirs in
                       (("to_q", "q_proj"), ("to_k", "k_proj"), ("to_v", "v_proj"), ("to_out", "o_proj"),
                        ("q_norm", "q_norm"), ("k_norm", "k_norm"))},
                    **{f"decoder.{i}.ffn.w_{ours}.": f"layers.{i}.mlp.{ours}_proj." for ours in ("gate", "up", "down")}}
    zlab = zlab_drafter_holding(renamed(weights, renames, ()), target.config, len(drafter.decoder),
                                drafter.tap_proj.in_features // HIDDEN, module.BLOCK, mask_id)
    with torch.no_grad():
        zlab_draft = zlab_block_logits(zlab, target, input_ids, tapped, anchors, module.BLOCK, mask_id)
        draft = target.lm_head(hidden)  # the script's head is the target's own
    slot, row, source = block_slots(anchors[..., None] + torch.arange(module.BLOCK))
    return [RecordedStep(
        fc_in_features=drafter.tap_proj.in_features, fed_features=tapped, raw=layer_outputs(target, input_ids),
        real=torch.ones(input_ids.shape, dtype=torch.bool), draft=draft.flatten(0, 1),
        zlab_draft=zlab_draft.flatten(0, 2), teacher=teacher_logits[row, source], slot=slot, row=row, source=source,
        valid=torch.ones_like(slot, dtype=torch.bool), loss=loss.item())]


def recorded_offline_hidden_states_file(module, monkeypatch, target_dir, target, bugs) -> list[RecordedStep]:
    from dflash.model import DFlashDraftModel

    samples, teachers, logits, losses = [], [], [], []
    record_calls(monkeypatch, module.HiddenStateFile, "next_sample", samples)
    record_calls(monkeypatch, module, "teacher_logits", teachers)
    record_calls(monkeypatch, DFlashDraftModel, "compute_logits", logits, weights_of_self=True)
    record_calls(monkeypatch, module, "sample_loss", losses)
    run_one_step(module, monkeypatch, target_dir, bugs)
    assert len(losses) == module.SAMPLES_PER_STEP  # each sample its own drafter call, one step over them
    steps = []
    for (_, (input_ids, features, _)), (_, teacher), ((drafter, *_), draft_logits, weights), loss_call in zip(
            samples, teachers, logits, losses):
        (*_, anchors, _), loss = loss_call
        block, mask_id = drafter.block_size, drafter.mask_token_id
        zlab = zlab_drafter_holding(weights, target.config, len(drafter.layers), drafter.fc.in_features // HIDDEN,
                                    block, mask_id)
        with torch.no_grad():
            zlab_draft = zlab_block_logits(zlab, target, input_ids[None], features[None], anchors[None], block,
                                           mask_id)
        slot, row, source = block_slots(anchors[None, :, None] + torch.arange(block))
        steps.append(RecordedStep(
            fc_in_features=drafter.fc.in_features, fed_features=features[None],
            raw=layer_outputs(target, input_ids[None]), real=torch.ones(1, len(input_ids), dtype=torch.bool),
            draft=draft_logits.detach(), zlab_draft=zlab_draft.flatten(0, 2), teacher=teacher[source], slot=slot,
            row=row, source=source, valid=torch.ones_like(slot, dtype=torch.bool), loss=loss.item()))
    return steps


RECORDERS = {"padded_batch": recorded_padded_batch, "packed_documents": recorded_packed_documents,
             "precomputed_targets": recorded_precomputed_targets,
             "own_modulelist_no_config": recorded_own_modulelist_no_config,
             "offline_hidden_states_file": recorded_offline_hidden_states_file}


def dflash_loss_by_slot(draft, teacher, slot, row, valid, gamma: float) -> float:
    """DFlash's loss over slots that each carry their own target (noise drawn per slot, padding): KL(teacher ||
    draft), weight 0 at slot 0 and exp(-(k-1)/gamma) after, per row sum(w*mask*kl) / (sum(mask) + 1e-5), then
    the mean over rows."""
    log_p, log_q = teacher.double().log_softmax(-1), draft.double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    weight = torch.where(slot == 0, 0.0, torch.exp(-(slot.double() - 1) / gamma))
    mask = (valid & (slot > 0)).double()
    per_row = [(weight * mask * kl)[row == r].sum() / (mask[row == r].sum() + 1e-5) for r in row.unique()]
    return torch.stack(per_row).mean().item()


@pytest.mark.parametrize("run", list(RECORDED_RUNS))
@pytest.mark.parametrize("name", list(RECORDERS))
def test_recorded_step_is_the_reference_but_for_the_named_bugs(name, run, target_dir, target, monkeypatch):
    bugs = set(RECORDED_RUNS[run])
    for step in RECORDERS[name](load_script(name), monkeypatch, target_dir, target, bugs):
        # fc: the first four feature layers under fc_4_of_5, all five otherwise, each the output of decoder layer id
        fed = LAYERS[:4] if "fc_4_of_5" in bugs else LAYERS
        assert step.fc_in_features == len(fed) * HIDDEN
        expected = torch.cat([step.raw[i] for i in fed], dim=-1)
        assert close(step.fed_features[step.real], expected[step.real])

        # the drafter: every block as z-lab's drafter with the same weights drafts it alone (mask, positions, RoPE)
        assert close(step.draft, step.zlab_draft)

        # targets: the head over decoder layer 9 or the last layer, at position a+k-1, plus noise of std 0.5 or none
        scored = step.valid & (step.slot > 0)
        teacher_layer = 9 if "targets_layer_9" in bugs else TARGET_LAYERS - 1
        clean = next_token_logits(target, step.raw[teacher_layer][step.row, step.source])[scored]
        if "target_noise_0.5" in bugs:
            offset = step.teacher[scored] - clean
            assert abs(offset.mean().item()) < 0.02 and abs(offset.std().item() - 0.5) < 0.02
        else:
            assert close(step.teacher[scored], clean)
        if "targets_layer_9" in bugs:  # and not the last layer's
            from_last = next_token_logits(target, step.raw[TARGET_LAYERS - 1][step.row, step.source])
            assert not close(step.teacher[scored], from_last[scored])

        # loss: the decayed KL with the gamma the bug names, and not the other one
        gamma, other = (7.0, 4.0) if "gamma_7" in bugs else (4.0, 7.0)
        args = (step.draft, step.teacher, step.slot, step.row, step.valid)
        assert step.loss == pytest.approx(dflash_loss_by_slot(*args, gamma), rel=1e-5)
        assert step.loss != pytest.approx(dflash_loss_by_slot(*args, other), rel=1e-3)
