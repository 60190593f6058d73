"""The trainer corpus (tests/trainer_corpus/): each team's script runs, and each planted bug is what its name says.

Every script runs as a subprocess (sound and with all four bugs, 2 steps) and must exit 0 printing finite losses.
Then each script is imported and its own pieces are held by value to an independent computation made here: the
target's layer outputs taken with forward hooks (not `output_hidden_states`), the target's next-token logits as
lm_head(final_norm(raw output of the last decoder layer)) read at position p - 1 for a slot at position p, the
drafter's logits block by block in z-lab's inference-style call (the in-house drafter's weights loaded into
z-lab's DFlashDraftModel), and DFlash's decayed loss written out afresh.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_world.target_training import distinct_random_qwen3

CORPUS = Path(__file__).resolve().parent / "trainer_corpus"
SCRIPTS = ("zlab_blocks_one_call", "zlab_per_anchor", "own_drafter_targets_inside")
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


def test_each_script_runs_sound_and_with_all_bugs(target_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name in SCRIPTS:
        for bugs in ((), BUGS):
            cmd = [sys.executable, str(CORPUS / f"{name}.py"), "--target", str(target_dir), "--steps", "2"]
            cmd += [arg for bug in bugs for arg in ("--bug", bug)]
            runs[name, bugs] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for (name, bugs), proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} {bugs}: exit {proc.returncode}\n{err[-2000:]}"
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
    import copy

    from dflash.model import DFlashDraftModel

    config = copy.deepcopy(target_config)
    config.num_target_layers = target_config.num_hidden_layers
    config.num_hidden_layers = len(own.blocks)
    config.layer_types = ["full_attention"] * len(own.blocks)
    n_features = own.context_proj.in_features // target_config.hidden_size
    config.dflash_config = {"target_layer_ids": list(LAYERS[:n_features]), "block_size": block,
                            "mask_token_id": mask_id}
    zlab = DFlashDraftModel(config)
    weights = {".".join(ZLAB_NAMES.get(part, part) for part in name.split(".")): tensor
               for name, tensor in own.state_dict().items() if name.split(".")[0] in ZLAB_NAMES}
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
