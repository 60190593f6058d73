"""`--chat-template auto|none|FILE` and `--chat-template-kwargs JSON`: how a prompt's turns become ids.

`auto` uses the target tokenizer's own template when it has one (else the raw text), `none` never
does, `FILE` renders with that Jinja template instead of the tokenizer's. The kwargs go to
`apply_chat_template` (e.g. `{"enable_thinking": false}`, Qwen3's thinking switch). Both are recorded
in the report: they move τ as much as a bug does (z-lab/dflash #133).
"""

from __future__ import annotations

import hashlib
import json
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from foundation.errors import AuditError, plain_reason
from foundation.inputs import read_utf8

CHAT_TEMPLATE_HELP = "auto | none | FILE (a Jinja chat template); on/off: the older names of auto-required/none"


@dataclass
class ChatTemplate:
    mode: str  # "auto", "required" (the older "on"), "none" or "file"
    kwargs: dict = field(default_factory=dict)
    file: Path | None = None
    text: str | None = None  # the FILE's template

    @classmethod
    def parse(cls, value: str = "auto", kwargs_json: str | dict | None = None) -> ChatTemplate:
        kwargs = parse_kwargs(kwargs_json)
        modes = {"auto": "auto", "none": "none", "off": "none", "on": "required"}
        if value in modes:
            return cls(modes[value], kwargs)
        path = Path(value)
        if not path.exists():
            raise AuditError(f"--chat-template {value}: neither auto, none nor an existing template file")
        text = read_utf8(path, "chat template file")
        if not text.strip():
            raise AuditError(f"--chat-template {value}: the template file is empty")
        check_jinja(text, value)
        return cls("file", kwargs, path, text)

    def with_kwargs(self, **extra) -> ChatTemplate:
        return ChatTemplate(self.mode, {**self.kwargs, **extra}, self.file, self.text)

    def template(self, tokenizer) -> str | None:
        """The template text in use for `tokenizer`, or None when prompts go in as raw text."""
        if self.mode == "none":
            return None
        if self.mode == "file":
            return self.text
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # named templates: the default one
            own = own.get("default")
        if self.mode == "required" and not own:
            raise AuditError("--chat-template on: the target tokenizer has no chat template")
        return own or None

    def install(self, tokenizer):
        """`tokenizer` with the FILE's template as its own (what the references' code then renders with)."""
        if self.mode == "file":
            tokenizer.chat_template = self.text
        return tokenizer

    def check_kwargs(self, tokenizer) -> None:
        """Kwargs without a template to take them, or a thinking switch the template never reads, are errors:
        they would be recorded yet change nothing."""
        template = self.template(tokenizer)
        if self.kwargs and template is None:
            raise AuditError("--chat-template-kwargs: no chat template is applied (--chat-template none, or auto "
                             "with a tokenizer that has none), so the kwargs would change nothing")
        for key in self.kwargs:
            if template is not None and key not in template:
                raise AuditError(f"--chat-template-kwargs: the chat template never reads {key!r}")

    def render(self, tokenizer, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ending in a user turn, with the generation prompt."""
        template = self.template(tokenizer)
        if template is None:
            if len(messages) != 1:
                text = "\n\n".join(m["content"] for m in messages)  # no template: turns as plain text
            else:
                text = messages[0]["content"]
            return tokenizer(text)["input_ids"]
        with self.rendering():
            rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True, **self.kwargs)
        # The template holds any BOS; adding special tokens again would double it.
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def named(self) -> str:
        """The template as a message names it: the flag and its file, or the tokenizer's own."""
        if self.mode == "file":
            return f"--chat-template {self.file}"
        return f"--chat-template {'on' if self.mode == 'required' else 'auto'} (the target tokenizer's own template)"

    def rendering(self):
        """Around every call that runs this template (ours, or a reference's code rendering the template `install`
        put in the tokenizer): `template_failures` naming it."""
        return template_failures(self.named())

    def ids(self, tokenizer, messages: list[dict]):
        """Token ids [1, T] (a torch tensor) of the conversation."""
        import torch  # here: a static compare imports this module and never torch (tests/test_start_fast.py)

        ids = self.render(tokenizer, messages)
        if not ids:
            raise AuditError(f"prompt {messages[-1]['content'][:40]!r} tokenizes to nothing")
        return torch.tensor([ids], dtype=torch.long)

    def describe(self, tokenizer=None) -> dict:
        template = self.template(tokenizer) if tokenizer is not None else self.text
        return {"mode": {"required": "on"}.get(self.mode, self.mode), "file": str(self.file) if self.file else None,
                "kwargs": self.kwargs, "applied": template is not None,
                "sha256": hashlib.sha256(template.encode()).hexdigest()[:16] if template else None}


@contextmanager
def template_failures(named: str, error: type[Exception] = AuditError):
    """The one guard where a chat template renders: whatever the template raises as it runs (its own
    `raise_exception`, e.g. on role order; the sandbox stopping it: a range past its limit, an unsafe attribute; an
    undefined name, a type error, a recursion without end) is the template's failure, one line (`error`) naming the
    template (`named`) and its line."""
    try:
        yield
    except (AuditError, error, MemoryError):  # already one line; out of memory is the CLI's own line
        raise
    except Exception as exc:  # noqa: BLE001 -- anything a template runs is the user's template code
        said = plain_reason(str(exc)) or "no reason given"
        raise error(f"{named}: the template failed{template_line(exc)} while rendering ({said})") from None


def template_line(exc: BaseException) -> str:
    """` at its line N`, where `exc` was raised (jinja compiles a template to code whose frames carry the template's
    line numbers under the file name '<template>'), or nothing when no frame is the template's."""
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == "<template>"]
    return f" at its line {lines[-1]}" if lines else ""


def kwargs_from_json(kwargs_json: str | None) -> dict:
    """The kwargs JSON as its object; ValueError (naming no flag: the flag's declaration names it) otherwise."""
    if kwargs_json is None or not kwargs_json.strip():
        return {}
    try:
        kwargs = json.loads(kwargs_json)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"invalid JSON ({getattr(exc, 'msg', 'nested too deep')})") from None
    if not isinstance(kwargs, dict):
        raise ValueError("expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    reserved = {"messages", "tokenize", "add_generation_prompt", "chat_template", "conversation"} & set(kwargs)
    if reserved:
        raise ValueError(f"{sorted(reserved)} are set by the tool, not by kwargs")
    return kwargs


def parse_kwargs(kwargs_json: str | dict | None) -> dict:
    """`--chat-template-kwargs` as given to code, not to the CLI (whose flags model reads it)."""
    if isinstance(kwargs_json, dict):
        return dict(kwargs_json)
    try:
        return kwargs_from_json(kwargs_json)
    except ValueError as exc:
        raise AuditError(f"--chat-template-kwargs: {exc}") from None


def check_jinja(text: str, where: str) -> None:
    """A template that does not compile is a one-line error before any model loads."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise AuditError(f"--chat-template {where}:{exc.lineno}: not a Jinja template ({exc.message})") from None


def thinking_settings(template: ChatTemplate, tokenizer) -> dict[str, ChatTemplate]:
    """`--tau-by thinking`: the same template with thinking on and off, through z-lab's own switch
    (`dflash.benchmark._reasoning_kwargs`, which refuses a template that has no `enable_thinking`)."""
    from dflash.benchmark import _reasoning_kwargs

    text = template.template(tokenizer)
    if text is None:
        raise AuditError("--tau-by thinking needs a chat template (the tokenizer's, or --chat-template FILE)")
    try:
        return {mode: template.with_kwargs(**_reasoning_kwargs(mode, text)) for mode in ("on", "off")}
    except ValueError:
        raise AuditError("--tau-by thinking: the chat template has no enable_thinking switch") from None
