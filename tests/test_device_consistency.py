"""Every tensor of the dynamic path is made on the model's device: the live DFlash and DDTree
loops, the hidden-state capture that builds the offline cache, and the offline replay of both
walks (DFlash and DFlash2 drafters). See tests/device_check.py for why the check is on the call
(it can fail on a CPU-only machine), and the planted tests below for proof that it does."""

from __future__ import annotations

import torch

from impl import ddtree
from impl.ddtree import ddtree_decode
from impl.decoding import dflash_decode
from impl.offline import load_or_build_cache, offline_rounds
from tests.device_check import REPO, WATCHED, DeviceAudit, audit_device

MAX_NEW_TOKENS = 24


def placed(pair):
    drafter, target, prompts, stop_ids = pair
    device = audit_device()
    return drafter.to(device), target.to(device), prompts[:2], stop_ids


def test_live_capture_and_replay_make_every_tensor_on_the_models_device(trained_pair, dflash2_pair, test_world,
                                                                       tmp_path):
    drafter, target, prompts, stop_ids = placed(trained_pair)
    drafter2, _, _, _ = placed(dflash2_pair)
    with DeviceAudit() as audit:
        for _, ids in prompts:  # the tokenizer's ids stay on the CPU: the loops move them
            dflash_decode(drafter, target, ids, MAX_NEW_TOKENS, stop_ids)
            dflash_decode(drafter2, target, ids, MAX_NEW_TOKENS, stop_ids)
            ddtree_decode(drafter, target, ids, MAX_NEW_TOKENS, stop_ids, budget=8)
        cache = load_or_build_cache(tmp_path, test_world.target, target, prompts, MAX_NEW_TOKENS, stop_ids)
        for entry in cache.prompts:
            offline_rounds(drafter, target, cache, entry, "dflash")
            offline_rounds(drafter2, target, cache, entry, "dflash")
            offline_rounds(drafter, target, cache, entry, "ddtree", budget=8)
    assert audit.violations == []
    assert audit.factory_calls > 50  # the project's own factories really ran under the check


def test_a_planted_bare_factory_is_caught():
    with DeviceAudit(watched=(*WATCHED, REPO / "tests")) as audit:
        torch.zeros(3)  # the planted violation
        torch.tensor([1, 2], device=None)
        torch.ones(2, device=audit_device())  # said where: fine
        torch.zeros_like(torch.ones(2, device=audit_device()))  # follows its input: fine
    assert [v.split(": ", 1)[1] for v in audit.violations] == ["torch.zeros without device=",
                                                               "torch.tensor without device="]
    assert all(v.startswith("tests/test_device_consistency.py:") for v in audit.violations)


def test_a_bare_factory_planted_in_the_ddtree_loop_is_caught(trained_pair, monkeypatch):
    drafter, target, prompts, stop_ids = placed(trained_pair)
    planted = compile(  # the tree mask as a careless edit would write it, compiled as impl/ddtree.py's code
        "def ancestor_mask(self, device):\n"
        "    mask = torch.zeros(len(self), len(self), dtype=torch.bool)\n"
        "    for node in range(len(self)):\n"
        "        if self.parents[node] >= 0:\n"
        "            mask[node] = mask[self.parents[node]]\n"
        "        mask[node, node] = True\n"
        "    return mask.to(device)\n", str(REPO / "impl" / "ddtree.py"), "exec")
    namespace = {"torch": torch}
    exec(planted, namespace)
    monkeypatch.setattr(ddtree.DraftTree, "ancestor_mask", namespace["ancestor_mask"])
    with DeviceAudit() as audit:
        ddtree_decode(drafter, target, prompts[0][1], 8, stop_ids, budget=4)
    assert audit.violations and all(v.startswith("impl/ddtree.py:2: torch.zeros without device=")
                                    for v in audit.violations)
