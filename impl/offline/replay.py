"""The drafter's blocks for several cached prompts at once, each at its own anchor: the
drafter's own attention pieces (`DraftAttention.queries/keys_values/attend`), fed keys
from per-prompt banks instead of one concatenated sequence."""

from __future__ import annotations

import torch
from torch import nn

from foundation.placement import model_device, model_dtype
from impl.anchors import anchor_blocks
from impl.masks import inference_mask, within_window
from impl.model import DFlashDrafter, convolved, rms_norm
from impl.offline.cache import CachedPrompt


def block_key_mask(anchors: torch.Tensor, key_positions: torch.Tensor, sizes: torch.Tensor, block_len: int,
                   window: int | None, causal: bool) -> torch.Tensor:
    """[A, S, S + L] bool: what block j (anchor a_j, `sizes[j]` real slots) sees of its keys.

    Keys are the block's own S slots (`inference_mask` of one block; slots past the block's
    size are padding nobody sees), then the context positions `key_positions` [A, L]
    (visible when < a_j, and within the window on sliding layers). Per block this is exactly
    `inference_mask(a_j, sizes[j], ...)`, block and context swapped.
    """
    device = anchors.device
    q_pos = anchors[:, None, None] + torch.arange(block_len, device=device)[None, :, None]  # [A, S, 1]
    k_pos = key_positions[:, None, :]
    sees_context = (k_pos >= 0) & (k_pos < anchors[:, None, None]) & within_window(q_pos, k_pos, window)
    real_slot = torch.arange(block_len, device=device)[None, None, :] < sizes[:, None, None]
    sees_block = inference_mask(0, block_len, sliding_window=window, causal=causal, device=device)[None] & real_slot
    return torch.cat([sees_block.expand(len(anchors), -1, -1), sees_context.expand(-1, block_len, -1)], dim=-1)


class BlockReplay:
    """`DFlashDrafter.forward` for blocks of several cached prompts at once, each at its own anchor.

    Every prompt's context (fc, hidden_norm, each layer's K/V with rotary) is projected once
    into a per-layer bank `[P, kv, B + T_max, d]`: the first B rows take the current block's
    K/V, then context position t sits at row B + t. A block attends to exactly the keys
    `inference_mask` allows: its own slots and its prompt's context before the anchor (a
    gathered window on sliding layers). Keys past the furthest anchor are cut off, not just
    masked, and banks of finished prompts are dropped (`keep`), so nothing is copied per
    step while every prompt drafts one block.
    """

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, entries: list[CachedPrompt],
                 block_positions=None):
        """`block_positions(anchors [A]) -> [A, S]`: the rotary positions of each block's slots where a replay
        asks for other ones than the anchor's onwards (the long-context audit's variants); the context keeps its
        own positions."""
        self.drafter, self.target = drafter, target
        self.block_positions = block_positions
        self.tokens = [entry.token_ids.tolist() for entry in entries]
        self.bank_row = {p: p for p in range(len(entries))}  # prompt -> row of the banks
        dtype, device = model_dtype(drafter), model_device(drafter)
        self.device = device
        block_len = drafter.block_size
        context_len = max(len(ids) for ids in self.tokens)
        cos, sin = drafter.rotary_emb(torch.empty(0, dtype=dtype, device=device),
                                      torch.arange(context_len + block_len, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [T + B, d], indexed by position
        # Rows past a prompt's end lie past every anchor of that prompt: never seen.
        self.keys = [torch.zeros(len(entries), layer.self_attn.kv_heads, block_len + context_len,
                                 layer.self_attn.head_dim, dtype=dtype, device=device) for layer in drafter.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        for p, entry in enumerate(entries):
            context = drafter.project_context(entry.features(drafter.target_layer_ids).to(device, dtype))
            length = context.shape[1]
            rows = slice(block_len, block_len + length)
            for layer, keys, values in zip(drafter.layers, self.keys, self.values):
                k, v = layer.self_attn.keys_values(context, self.cos[None, :length], self.sin[None, :length])
                keys[p, :, rows], values[p, :, rows] = k[0], v[0]

    def keep(self, prompts: list[int]) -> None:
        """Drop the banks of every prompt not in `prompts` (finished walks)."""
        if len(prompts) == len(self.bank_row):
            return
        rows = torch.tensor([self.bank_row[p] for p in prompts], device=self.device)
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.bank_row = {p: i for i, p in enumerate(prompts)}

    def hidden(self, prompts: torch.Tensor, anchors: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [A, n, H] of the proposing slots of the block of `prompts[j]` at
        `anchors[j]` with `sizes[j]` slots: slots 1.. (B - 1; slot 0 holds the known token and no one reads
        its output), or every slot under the sample-from-anchor layout (impl/slot_layout.py), or every slot
        of a drafter that reads the whole block (DSpark's Markov chain, XPress's refiner)."""
        drafter, block_len, device = self.drafter, self.drafter.block_size, self.device
        prompts, anchors, sizes = prompts.to(device), anchors.to(device), sizes.to(device)
        block = anchor_blocks(torch.tensor([self.tokens[p][a] for p, a in zip(prompts.tolist(), anchors.tolist())],
                                           device=device), block_len, drafter.mask_token_id)
        slot_positions = anchors[:, None] + torch.arange(block_len, device=device)[None]  # [A, S]
        rotary = slot_positions if self.block_positions is None else self.block_positions(anchors)
        cos, sin = self.cos[rotary], self.sin[rotary]  # [A, S, d]
        bank_rows = [self.bank_row[p] for p in prompts.tolist()]
        one_per_bank = bank_rows == list(range(len(self.bank_row)))  # block j writes bank row j
        index = torch.tensor(bank_rows, device=device)
        context_len = int(anchors.max())  # no block sees context at or past its anchor

        def key_plan(window, causal):
            if window is None or window - 1 >= context_len:
                context, rows = torch.arange(context_len, device=device).expand(anchors.numel(), -1), None
            else:  # a block at anchor a sees at most context a - window + 1 .. a - 1
                context = anchors[:, None] - (window - 1) + torch.arange(window - 1, device=device)[None]
                rows = block_len + context.clamp(min=0)
            return rows, block_key_mask(anchors, context, sizes, block_len, window, causal)

        plans = drafter.layer_masks(key_plan)
        x = drafter.embed(self.target, block)
        # The last layer computes queries of the proposing slots only (`skip` = the slots before them), unless
        # none is skipped or DFlash2's convolutions mix slot 0 into slot 1.
        skip = drafter.spec.first_proposing_slot
        last = len(drafter.layers) - 1 if drafter.spec.family == "dflash" and skip else -1
        for i, (layer, (rows, mask), keys, values) in enumerate(zip(drafter.layers, plans, self.keys, self.values)):
            attn = layer.self_attn

            def attention(h, i=i, rows=rows, mask=mask, keys=keys, values=values):
                k, v = attn.keys_values(h, cos, sin)
                if i == last:  # every slot's K/V, but queries (and all after them) of the proposing slots only
                    h, mask, q_cos, q_sin = h[:, skip:], mask[:, skip:], cos[:, skip:], sin[:, skip:]
                else:
                    q_cos, q_sin = cos, sin
                q = attn.queries(h, q_cos, q_sin)
                if rows is not None:  # the block, then the window before each anchor
                    k = torch.cat([k, keys[index[:, None], :, rows].transpose(1, 2)], dim=2)
                    v = torch.cat([v, values[index[:, None], :, rows].transpose(1, 2)], dim=2)
                elif one_per_bank:  # the block's K/V go into its bank: the context is not copied
                    keys[:, :, :block_len], values[:, :, :block_len] = k, v
                    k, v = keys[:, :, :block_len + context_len], values[:, :, :block_len + context_len]
                else:  # several blocks of one prompt (look-ahead)
                    k = torch.cat([k, keys[index, :, block_len:block_len + context_len]], dim=2)
                    v = torch.cat([v, values[index, :, block_len:block_len + context_len]], dim=2)
                return attn.attend(q, k, v, mask[:, None])

            h = convolved(layer.attention_conv, attention, rms_norm(layer.input_layernorm, x))
            x = (x[:, skip:] if i == last else x) + h
            x = x + convolved(layer.mlp_conv, layer.mlp, rms_norm(layer.post_attention_layernorm, x))
        if drafter.reads_whole_block:
            return rms_norm(drafter.norm, x)
        return rms_norm(drafter.norm, x if last >= 0 else x[:, skip:])


