"""Tensors a process holds only part of: FSDP2's sharded parameters and gradients (DTensors), read without torch's
implicit collectives.

On a DTensor, a reduction's `float()` is the local shard's value (a sum of the shard, not of the parameter), a
`full_tensor()` is an all-gather, and a module's `state_dict()` reshards it. The recorders run beside the script's
own collectives: what one rank alone did with a DTensor would read a shard as if it were the whole, or issue a
collective (or reshard a module, so that its next all-gather comes early) that the other ranks do not, and the
script's own collectives would then pair with the wrong ones. So: a shard is read as a shard (`local_value`), the
whole is read only where this process holds all of it (`whole_value`), and what is added across ranks is added by
collectives every rank issues alike (`whole_sums`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def is_distributed_tensor(t) -> bool:
    """A DTensor (or anything placed like one): its local part and its placements on a device mesh."""
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A parameter's values held by this process: a sharded DTensor's local shard, else the tensor."""
    return t.to_local() if is_distributed_tensor(t) else t


def whole_value(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's whole value where this process holds all of it (a plain tensor; a DTensor replicated, or sharded
    on a one-rank mesh), else None: read from here, the rest of it is on other ranks."""
    if not is_distributed_tensor(t):
        return t
    local = t.to_local()
    if all(p.is_replicate() or p.is_shard() for p in t.placements) and tuple(local.shape) == tuple(t.shape):
        return local
    return None


def whole_sums(tensors: Sequence[torch.Tensor],
               reductions: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> list[list[float] | None]:
    """Each reduction (a sum over the elements: their sum, their sum of squares, how many are not zero) of each
    tensor as a whole, in float64: a DTensor's is its local shard's, added across the ranks holding its other shards
    by one all-reduce per mesh dimension it is sharded on. Every rank must call this with the same tensors in the
    same order (the optimizer's parameters, at a step every rank takes): the collectives are then the same on every
    rank. None for a tensor whose local values do not add up to its whole (a pending reduction, `Partial`)."""
    rows: list[torch.Tensor] = []
    # id(process group) -> (the group, the rows of the tensors sharded across it), in the order every rank sees them
    across: dict[int, tuple[object, list[int]]] = {}
    unknown: set[int] = set()
    for i, t in enumerate(tensors):
        local = local_value(t).detach().double()
        rows.append(torch.stack([r(local).double().reshape(()) for r in reductions]))
        if not is_distributed_tensor(t):
            continue
        for dim, placement in enumerate(t.placements):
            if placement.is_shard():
                group = t.device_mesh.get_group(dim)
                across.setdefault(id(group), (group, []))[1].append(i)
            elif not placement.is_replicate():
                unknown.add(i)
    if across:
        import torch.distributed as dist

        for group, members in across.values():
            block = torch.stack([rows[i] for i in members])
            dist.all_reduce(block, group=group)
            for i, row in zip(members, block):
                rows[i] = row
    return [None if i in unknown else [float(v) for v in row.tolist()] for i, row in enumerate(rows)]


def square_sum(t: torch.Tensor) -> torch.Tensor:
    return t.square().sum()


def nonzero_count(t: torch.Tensor) -> torch.Tensor:
    return torch.count_nonzero(t)
