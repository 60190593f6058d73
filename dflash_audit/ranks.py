"""This process's share of the work under torchrun: prompts sharded over the ranks (gloo), the
hidden-state cache built once by rank 0 and read by the others, results gathered on rank 0.
Each rank's device is its own GPU (`LOCAL_RANK`, `foundation.placement.resolve_device`)."""

from __future__ import annotations

import os

import torch


class Ranks:
    """This process's share of the prompts under torchrun (gloo), or everything otherwise."""

    def __init__(self, env=os.environ):
        self.world = int(env.get("WORLD_SIZE", "1"))
        self.rank = int(env.get("RANK", "0"))
        self.owns_group = self.world > 1 and not torch.distributed.is_initialized()
        if self.owns_group:
            torch.distributed.init_process_group("gloo")

    @classmethod
    def single(cls) -> Ranks:
        """One process doing everything, whatever the environment says."""
        return cls({})

    def shard(self, items: list) -> list:
        return items[self.rank::self.world]

    def rank_zero_first(self, make):
        """`make()` on rank 0, then on the others (which then find what rank 0 wrote to disk)."""
        if self.world == 1:
            return make()
        result = make() if self.rank == 0 else None
        torch.distributed.barrier()
        return result if self.rank == 0 else make()

    def gather(self, results: list[dict]) -> list[dict]:
        if self.world == 1:
            return results
        parts: list = [None] * self.world
        torch.distributed.all_gather_object(parts, results)
        return [item for part in parts for item in part]

    def close(self) -> None:
        if self.owns_group:
            torch.distributed.destroy_process_group()
            self.owns_group = False
