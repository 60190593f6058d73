"""A record's `loss_mask`: its coverage, and whether the tokens it supervises lie in the chat template's assistant
turns.

The assistant turns are found in the record's own text by the template's words: the assistant header is what the
generation prompt adds to a rendered user turn, the turn's end what follows an assistant message's content
(`Turns.of`). A token is in a turn when its characters lie after a header and up to the end of that turn (the turn's
end marker included, or the record's end when the turn is cut off). Writers differ in which turns they supervise
(speculators' preprocessing one row per assistant turn, the earlier ones context: data_generation/preprocessing.py:
244-318; SpecForge every assistant turn), so a mask is held only to this: nothing outside an assistant turn is
supervised. A record whose text does not re-tokenize to its own ids is left unchecked, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROBE_USER, PROBE_ANSWER = "Q9", "A7"


@dataclass
class Turns:
    header: str
    end: str

    @classmethod
    def of(cls, tokenizer, template: str, kwargs: dict) -> Turns | str:
        """The template's assistant header and turn end, or why they cannot be told."""
        def render(messages, prompt):
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=prompt, **kwargs)

        try:
            user = [{"role": "user", "content": PROBE_USER}]
            bare, prompted = render(user, False), render(user, True)
            full = render([*user, {"role": "assistant", "content": PROBE_ANSWER}], False)
        except Exception as exc:  # noqa: BLE001 -- a template that cannot render a probe turn
            return f"the chat template cannot render a user and an assistant turn ({' '.join(str(exc).split())[:120]})"
        if not prompted.startswith(bare) or len(prompted) == len(bare):
            return "the chat template's generation prompt does not extend the rendered user turn"
        header = prompted[len(bare):]
        at = full.find(PROBE_ANSWER, len(bare))
        if at < 0:
            return "the chat template does not render an assistant message's content as given"
        end = full[at + len(PROBE_ANSWER):]
        if not end.strip():
            return "the chat template writes nothing after an assistant message (its turns' end is unknown)"
        if full.startswith(bare) and full[len(bare):at].strip():
            header = full[len(bare):at]  # the header a recorded turn carries (a generation prompt may add more)
        return cls(header, end)


@dataclass
class MaskCheck:
    length_ok: bool
    supervised: int
    tokens: int
    outside: list[int]  # supervised positions outside every assistant turn
    turns: int | None  # assistant turns found (None: not checked)
    turns_supervised: int | None
    unchecked: str | None = None  # why the turns were not checked

    @property
    def coverage(self) -> float:
        return self.supervised / self.tokens if self.tokens else 0.0


def token_spans(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]] | None:
    """The record's text and each token's character span: from the tokenizer's offsets when the text re-tokenizes to
    the same ids, else from each token decoded alone when those pieces make the text (a record tokenized turn by
    turn); None when neither holds."""
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == list(ids):
            return text, [tuple(span) for span in encoded["offset_mapping"]]
    except NotImplementedError:  # a slow tokenizer has no offsets
        pass
    pieces = [tokenizer.decode([token], clean_up_tokenization_spaces=False) for token in ids]
    if "".join(pieces) != text:
        return None
    spans, at = [], 0
    for piece in pieces:
        spans.append((at, at + len(piece)))
        at += len(piece)
    return text, spans


def turn_spans(text: str, turns: Turns) -> list[tuple[int, int]]:
    """Character ranges of each assistant turn's content and end marker."""
    spans, at = [], 0
    while True:
        head = text.find(turns.header, at)
        if head < 0:
            return spans
        start = head + len(turns.header)
        close = text.find(turns.end.strip(), start)
        stop = len(text) if close < 0 else min(len(text), close + len(turns.end.rstrip()) + 1)
        spans.append((start, stop))
        at = stop


def check_mask(mask: torch.Tensor, ids: torch.Tensor, tokenizer, turns: Turns | str | None) -> MaskCheck:
    values = mask.reshape(-1)
    tokens = int(ids.numel())
    supervised = int((values != 0).sum())
    if values.numel() != tokens:
        return MaskCheck(False, supervised, tokens, [], None, None, "its length differs from the token ids")
    if not isinstance(turns, Turns):
        return MaskCheck(True, supervised, tokens, [], None, None, turns or "no chat template is applied")
    found = token_spans(tokenizer, ids.tolist())
    if found is None:
        return MaskCheck(True, supervised, tokens, [], None, None,
                         "the record's text does not re-tokenize to its own ids")
    text, offsets = found
    spans = turn_spans(text, turns)
    # A token straddling a turn's edge (a BPE merge across it) counts as inside.
    inside = [any(a < stop and b > start for start, stop in spans) for a, b in offsets]
    outside = [p for p in range(tokens) if values[p] != 0 and not inside[p]]
    supervised_turns = sum(any(values[p] != 0 and offsets[p][0] < stop and offsets[p][1] > start
                               for p in range(tokens)) for start, stop in spans)
    return MaskCheck(True, supervised, tokens, outside, len(spans), supervised_turns)
