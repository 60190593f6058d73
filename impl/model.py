"""Our DFlash drafter, top to bottom.

A DFlash drafter is a few Qwen3-style decoder layers that denoise one block of B tokens
(`[known token, mask, mask, ...]`) in a single pass. It owns no embeddings or LM head:
both are borrowed from the target. What it sees of the target is the concatenation of
several target layers' hidden states ("context features"), projected by
`fc = Linear(len(target_layer_ids) * H, H)` and normalised by `hidden_norm`; every layer
attends over `K/V = concat(proj(context), proj(block))`.

The same `forward` serves training (all anchor blocks of a packed sequence at once, with
`masks.training_mask`) and inference (one block after the accepted context, with
`masks.inference_mask` and a KV cache). State-dict keys equal z-lab's `DFlashDraftModel`.

A DFlash2 drafter (`spec.family == "dflash2"`) is the same model plus, in every layer, a
grouped dynamic causal convolution around the attention and around the MLP, and a
candidate selector that reranks the unary top-k (`impl.dflash2`). Its state-dict keys are
the ones both references write to disk (the selector's codebooks carry no `.weight`).

A drafter with a reduced draft vocabulary (`spec.draft_vocab_size`, speculators' convention) owns
its head instead: `lm_head` [draft vocab, H], the target head's rows of the target ids it can
propose (frozen, as speculators keeps it), and the `d2t` offsets that map its ids to target ids
(`impl.vocab_mapping`). Its logits are scattered into the target vocabulary (-inf elsewhere, as
vLLM's `compute_logits` does), so every decoding path proposes target ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gptj.modeling_gptj import rotate_every_two
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

from impl.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from impl.dspark import ConfidenceHead, MarkovHead
from impl.masks import inference_mask, training_mask
from impl.spec import DraftSpec
from impl.vocab_mapping import target_ids
from impl.xpress import RefinerHead


class DraftCache:
    """Per-layer K/V of everything the drafter has already seen (rotary applied)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drops the block after a round)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


def rms_norm(norm: Qwen3RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """A Qwen3 RMSNorm as one fused op where that is bit-identical (fp32); the module itself otherwise."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of `x` [b, heads, n, d] at the positions whose `cos`/`sin` [b, n, r] are given: the
    first r dims are rotated, the rest pass through (partial rotary, r < d). Neox style rotates the two halves
    (transformers' `rotate_half`); interleaved (GPT-J) style the pairs (2i, 2i + 1) (transformers' GPT-J
    `rotate_every_two`), with cos/sin laid out to match (`DraftRotaryEmbedding`)."""
    turn = rotate_every_two if interleaved else rotate_half
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos[:, None] + turn(x) * sin[:, None]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rotated * cos[:, None] + turn(rotated) * sin[:, None], passed], dim=-1)


class DraftRotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding (transformers' scalings from ROPE_INIT_FUNCTIONS, its dynamic update and
    attention scaling) whose unscaled frequencies also honour `partial_rotary_factor`: Qwen3's own default
    ignores it and covers the whole head; transformers' partial-rotary models (Qwen3-Next) cover the rotated
    dims only, and the scaled rope types already do. For the interleaved style each frequency's cos/sin is
    repeated for its pair of dims, as GPT-J lays them out, instead of once per half."""

    def __init__(self, spec: DraftSpec):
        super().__init__(spec.qwen3_config())
        self.interleaved = spec.rope_style == "gptj"

    def forward(self, x, position_ids):
        cos, sin = super().forward(x, position_ids)
        if self.interleaved:
            half = cos.shape[-1] // 2  # neox lays out [f_0 .. f_{r/2-1}, f_0 .. f_{r/2-1}]
            cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
        return cos, sin

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs):
        if config.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            return Qwen3NextRotaryEmbedding.compute_default_rope_parameters(config, **kwargs)
        return Qwen3RotaryEmbedding.compute_default_rope_parameters(config, **kwargs)


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys and values also cover the projected target context.

    `queries`, `keys_values` and `attend` are the pieces every caller uses: the forward below
    and the batched offline replay (`impl.offline.replay`), so both compute one function."""

    def __init__(self, spec: DraftSpec, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=spec.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=spec.rms_norm_eps)
        self.interleaved = spec.rope_style == "gptj"  # the rotary style (`rotate`)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[b, n, H] -> rotated, normed queries [b, heads, n, d]."""
        b, n, _ = x.shape
        q = rms_norm(self.q_norm, self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        return rotate(q, cos, sin, self.interleaved)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[b, n, H] -> rotated, normed keys and values, each [b, kv_heads, n, d]."""
        b, n, _ = x.shape
        k = rms_norm(self.k_norm, self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin, self.interleaved), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # Below float32 the scores, softmax and weighted sum run in float32 and only the output is
        # rounded, as fused serving kernels accumulate: then the live loop (keys [context | block],
        # exactly the visible ones) and the replay (keys [block | context], cut at the furthest
        # anchor) differ only by float32 summation order, not by bfloat16 roundings of it.
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        # enable_gqa: each K/V head serves its query-head group without copying it.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5,
                                             enable_gqa=self.heads != self.kv_heads).to(dtype)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, cache: DraftCache | None = None) -> torch.Tensor:
        """`cos`/`sin` cover every new key (context, then block); the queries are the last `q_len`."""
        q_len = x.shape[1]
        q = self.queries(x, cos[:, -q_len:], sin[:, -q_len:])
        # The block's K/V follow the context's: the drafter reads the target through them.
        # One projection over both (rows are independent) costs one matmul call, not two.
        k, v = self.keys_values(torch.cat([context, x], dim=1), cos, sin)
        if cache is not None:
            k, v = cache.extend(self.layer_idx, k, v)
        return self.attend(q, k, v, mask)


def convolved(conv: GroupedDynamicCausalConv | None, sublayer, h: torch.Tensor) -> torch.Tensor:
    """`sublayer(h)`, inside the DFlash2 convolution pair when the layer has one."""
    if conv is None:
        return sublayer(h)
    h, output_delta = conv.prepare(h)
    return conv.finish(sublayer(h), output_delta)


class DraftLayer(nn.Module):
    def __init__(self, spec: DraftSpec, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(spec, layer_idx)
        self.mlp = Qwen3MLP(spec.qwen3_config())
        self.input_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if spec.family == "dflash2":
            conv = (spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size, spec.block_size)
            self.attention_conv, self.mlp_conv = GroupedDynamicCausalConv(*conv), GroupedDynamicCausalConv(*conv)

    def forward(self, x, context, cos, sin, mask, cache=None):
        x = x + convolved(self.attention_conv, lambda h: self.self_attn(h, context, cos, sin, mask, cache),
                          rms_norm(self.input_layernorm, x))
        return x + convolved(self.mlp_conv, self.mlp, rms_norm(self.post_attention_layernorm, x))


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(DraftLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.rotary_emb = DraftRotaryEmbedding(spec)
        self.fc = nn.Linear(spec.fc_in_features, spec.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.lm_head = None
        if spec.reduced_vocab:  # keys as vLLM reads a z-lab drafter: `lm_head.weight`, `d2t`
            self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.candidate_selector = None
        if spec.family == "dflash2":
            self.candidate_selector = CandidateSelector(spec.target_vocab_size, spec.hidden_size, spec.selector_rank,
                                                        spec.selector_top_k)
        # DSpark's Markov and confidence heads, XPress's refiner (impl/dspark.py, impl/xpress.py).
        self.markov_head = self.confidence_head = self.refiner_head = None
        if spec.has_markov_head:
            self.markov_head = MarkovHead(spec.target_vocab_size, spec.head_size, spec.markov_rank, spec.hidden_size,
                                          spec.markov_head_type)
        if spec.has_confidence_head:
            self.confidence_head = ConfidenceHead(
                spec.hidden_size + (spec.markov_rank if spec.confidence_head_with_markov else 0))
        if spec.family == "xpress":
            self.refiner_head = RefinerHead(spec.target_vocab_size, spec.head_size, spec.hidden_size, spec.block_size,
                                            spec.xpress_rank, spec.xpress_mlp_ratio)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def reads_whole_block(self) -> bool:
        """Whether proposals read every slot of the block (DSpark's Markov chain, XPress's refiner): the block is
        then always drafted whole, as vLLM drafts it, and its slots are handed over together."""
        return self.markov_head is not None or self.refiner_head is not None

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.spec.target_layer_ids)

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # DFlash2 starts as DFlash: identity convolutions (speculators' initialization).
        for module in self.modules():
            if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector, MarkovHead, RefinerHead)):
                module.reset_parameters()

    # -- masks ---------------------------------------------------------------------------
    def layer_masks(self, make) -> list[torch.Tensor]:
        """One mask per layer from `make(window, causal)`; sliding layers are causal in the block
        unless the spec says `sliding_window_non_causal`."""
        cache: dict[tuple, torch.Tensor] = {}
        masks = []
        for i in range(self.spec.num_hidden_layers):
            key = (self.spec.window_of(i), self.spec.block_is_causal(i))
            if key not in cache:
                cache[key] = make(*key)
            masks.append(cache[key])
        return masks

    def training_masks(self, document_ids: torch.Tensor, anchors: torch.Tensor) -> list[torch.Tensor]:
        return self.layer_masks(lambda window, causal: training_mask(
            document_ids, anchors, self.block_size, sliding_window=window, causal_block=causal))

    def inference_masks(self, context_len: int, block_len: int, device=None) -> list[torch.Tensor | None]:
        """None where a layer sees every key (full, non-causal attention): SDPA then skips the mask."""
        return self.layer_masks(lambda window, causal: None if window is None and not causal else inference_mask(
            context_len, block_len, sliding_window=window, causal=causal, device=device))

    # -- forward -------------------------------------------------------------------------
    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                masks: list[torch.Tensor] | None = None, cache: DraftCache | None = None) -> torch.Tensor:
        """Draft hidden states [b, q, H] (after the final norm).

        noise_embedding: [b, q, H] embedded block tokens; target_hidden: [b, c, F] raw
        context features; position_ids: [b, c + q] positions of the new keys (context, then
        block); masks: per-layer boolean masks, or None for inference masks over
        `[cache | context | block]`.
        """
        context = self.project_context(target_hidden)
        if masks is None:
            cached = len(cache) if cache is not None else 0
            masks = self.inference_masks(cached + context.shape[1], noise_embedding.shape[1],
                                         device=noise_embedding.device)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer, mask in zip(self.layers, masks):
            x = layer(x, context, cos, sin, mask, cache)
        return rms_norm(self.norm, x)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Raw context features [b, c, len(ids) * H] -> what every layer's K/V read [b, c, H]."""
        return rms_norm(self.hidden_norm, self.fc(target_hidden))

    # -- borrowed embeddings and head ----------------------------------------------------
    def embed(self, target: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, target.get_input_embeddings().weight) * self.spec.input_embedding_scale

    # -- a reduced draft vocabulary -------------------------------------------------------
    def set_vocab_mapping(self, d2t: torch.Tensor, target_head: nn.Module) -> None:
        """Take `d2t` and the target head's rows it selects (speculators: `lm_head_weight[t2d]`)."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            weight = target_head.weight
            self.lm_head.weight.copy_(weight[target_ids(self.d2t).to(weight.device)].to(self.lm_head.weight))

    def proposable_ids(self) -> torch.Tensor | None:
        """The target ids the head can propose, in draft-id order; None when it covers the whole vocabulary."""
        return target_ids(self.d2t) if self.lm_head is not None else None

    def verifier_head(self, head: nn.Module) -> nn.Module:
        """The target's head restricted to the draft vocabulary (speculators' `verifier_lm_head`): training
        targets live where the drafter's logits do."""
        if self.lm_head is None:
            return head
        return _RowsOf(head, self.proposable_ids())

    def draft_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Logits over the head's own vocabulary: the target's, or the draft vocabulary's (training)."""
        head = self.lm_head if self.lm_head is not None else head
        weight = head.weight
        logits = head(hidden.to(weight.device).contiguous()).to(hidden.device) * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compute_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Logits over the target vocabulary, on `hidden`'s device: a sharded target's head may sit on another one.
        A reduced draft vocabulary's logits land on their target ids, every other id gets -inf.

        `hidden` is made contiguous first: the callers pass slices (`rows[:, :2]`), and a strided bf16
        input sends the CPU's linear to a path ~600x slower (58.8 s vs 0.093 s for 16 rows of a 151,936-word
        head), which is what kept a Qwen3-1.7B-shape replay from finishing."""
        logits = self.draft_logits(hidden, head)
        if self.lm_head is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.spec.target_vocab_size), float("-inf"))
        full[..., self.proposable_ids().to(logits.device)] = logits
        return full


class _RowsOf(nn.Module):
    """`head` with only some output rows (a view of its weight: nothing is copied into the module)."""

    def __init__(self, head: nn.Module, rows: torch.Tensor):
        super().__init__()
        self.head, self.rows = head, rows

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight[self.rows.to(self.head.weight.device)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
