"""The two heads DSpark adds to a DFlash drafter: a Markov logit bias and a confidence head.

Markov head (rank r over the previous block token `prev`, added to the drafter's logits):
    vanilla: bias = W2 · W1[prev]
    gated:   bias = W2 · (sigmoid(G [h ; W1[prev]]) * W1[prev])          (h: the slot's hidden state)
    rnn:     s_k = g * s_{k-1} + (1 - g) * tanh(c),  bias_k = W2 · tanh(o),
             [g_raw ; c ; o] = J [s_{k-1} ; W1[prev_k] ; h_k],  g = sigmoid(g_raw),  s_{-1} = 0
Confidence head: one logit per slot, from h (or [h ; W1[prev]] with `confidence_head_with_markov`); trained
with a BCE toward the slot's analytical acceptance rate 1 - TV(draft, target).

In training the previous token is the true one (teacher forcing); at inference the block is drafted left to
right, each slot's pick becoming the next slot's previous token (vLLM's DSparkSpeculator). Slot k's previous
token is the token at the position before the one it proposes: under sample-from-anchor slot k proposes
p + k + 1 and follows the token at p + k (slot 0: the anchor); in the anchor-as-bonus layout slot k proposes
p + k and follows the one at p + k - 1 (slots 0 and 1 both follow the anchor).
Tensor names are speculators' (`markov_head.markov_w1.weight`, ..., `confidence_head.proj.weight`).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, head_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # the previous token, in the target's vocabulary
        self.markov_w2 = nn.Linear(rank, head_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' initialization of the embedding

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids.long())

    def step(self, embedded: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One slot: (bias [..., V], next state) from its previous token's embedding [..., r] and hidden [..., H]."""
        embedded = embedded.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(embedded), state
        hidden = hidden.to(embedded.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1)))
            return self.markov_w2(gate * embedded), state
        if state is None:
            state = embedded.new_zeros(embedded.shape)
        gate, candidate, out = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), state

    def block_bias(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases [N, B, V] of blocks: previous tokens [N, B], hidden states [N, B, H]."""
        embedded = self.embed(prev_ids)
        if self.head_type != "rnn":
            return self.step(embedded, hidden, None)[0]
        state, biases = None, []
        for slot in range(prev_ids.shape[1]):
            bias, state = self.step(embedded[:, slot], hidden[:, slot], state)
            biases.append(bias)
        return torch.stack(biases, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def confidence_features(hidden: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
    """The confidence head's input: the hidden state, with the Markov embedding beside it when given."""
    return hidden if embedded is None else torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)


def draft_left_to_right(head: MarkovHead, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: torch.Tensor,
                        first: int, pick):
    """The Markov chain through one block of every slot [b, S]: (tokens [b, S - first], probs or None).

    hidden [b, S, H] and base_logits [b, S, V] cover every slot of the block; slots before `first` propose
    nothing but still advance the chain (and an rnn state). `pick(logits [b, V])` returns (ids [b], probs or
    None). The anchor [b] is the first slot's previous token and, in the anchor-as-bonus layout, slot 1's too.
    """
    embedded_prev, state, tokens, probs = anchor, None, [], []
    for slot in range(hidden.shape[1]):
        bias, state = head.step(head.embed(embedded_prev), hidden[:, slot], state)
        if slot < first:
            continue
        ids, slot_probs = pick(base_logits[:, slot] + bias.to(base_logits.dtype))
        tokens.append(ids)
        if slot_probs is not None:
            probs.append(slot_probs)
        embedded_prev = ids
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None

