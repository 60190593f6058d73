"""Two DDP ranks (gloo on 127.0.0.1) train the same weights as one process on the same global batch."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from drafter_files.checkpoint import load_checkpoint
from impl.model import DFlashDrafter
from impl.train import train_drafter
from tests.helpers import TEXTS
from tests.test_train import TINY_RUN

# Every rank runs the single-process computation on half the rows; what differs is only the
# order in which gloo sums the two halves' gradients before dividing by 2. That moves fp32
# gradients by a few ulps (~1e-7 relative); Adam divides by sqrt(v) and so passes such
# differences through at most ~lr * relative error per step: 1e-6 over 3 steps is generous
# for that and still far below one real update (lr = 3e-3).
ATOL, RTOL = 1e-6, 1e-5
RUN = dict(TINY_RUN, steps=3, batch_size=4, grad_accum=2, noise_std=0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, world: int, port: int, target: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    train_drafter(target, TEXTS, out, **RUN)


def test_two_ranks_match_one_process(tiny_world, tmp_path):  # noqa: F811
    target = str(tiny_world / "target")
    single = train_drafter(target, TEXTS, tmp_path / "single.pt", **RUN)
    mp.spawn(rank_main, args=(2, free_port(), target, str(tmp_path / "ddp.pt")), nprocs=2, join=True)
    one, two = load_checkpoint(tmp_path / "single.pt"), load_checkpoint(tmp_path / "ddp.pt")
    assert two.step == one.step == 3
    # The logged losses are means over ranks: the same curve.
    torch.testing.assert_close(torch.tensor(two.training_state["history"]), torch.tensor(single["losses"]),
                               rtol=1e-5, atol=1e-7)
    for key, value in one.state_dict.items():
        torch.testing.assert_close(two.state_dict[key], value, atol=ATOL, rtol=RTOL, msg=key)
    # The weights really moved from their seeded initialisation, so agreement is not trivial.
    torch.manual_seed(RUN.get("seed", 0))
    initial = DFlashDrafter(one.spec).state_dict()
    moved = max((one.state_dict[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * ATOL
