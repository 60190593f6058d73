"""Parameter names: from a checkpoint's own scheme to the canonical (z-lab / ours / speculators) one.

Known schemes need no help: the canonical names themselves, behind any stack of wrapper
prefixes (`foundation.param_names.WRAPPER_PREFIXES`). Any other scheme
takes a `--key-map FILE`: one `PATTERN => REPLACEMENT` rule per line (Python `re.sub`),
applied in order to every name; blank lines and `#` comments are ignored. For a scheme
that is neither, `propose_key_map` writes such a file from shapes and name tokens; it is
only ever printed, never applied.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from foundation.param_names import VERIFIER_OWNED_KEYS, codebook_name, strip_wrapper_prefix

TOP_LEVEL = ("fc.weight", "hidden_norm.weight", "norm.weight",
             # DFlash2's candidate selector
             "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
             "candidate_selector.hidden_projection.weight")
LAYER_SUFFIXES = tuple(
    [f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")]
    + ["self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
       "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    # DFlash2's convolution pairs around attention and MLP
    + [f"{sub}_conv.{part}" for sub in ("attention", "mlp") for part in ("base_kernel", "kernel_projection.weight")])
LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


class KeyMapError(ValueError):
    """A --key-map file that cannot be used; names the line."""


def is_canonical(name: str) -> bool:
    if name in TOP_LEVEL or name in VERIFIER_OWNED_KEYS:
        return True
    match = LAYER_NAME.match(name)
    return bool(match) and match.group(2) in LAYER_SUFFIXES


def strip_prefixes(name: str) -> str:
    """The name behind its wrapper prefixes (and a codebook's `.weight`, which z-lab's own saves add)."""
    return codebook_name(strip_wrapper_prefix(name))


@dataclass
class KeyMapRule:
    pattern: re.Pattern
    replacement: str
    line: int


MAX_KEY_MAP_BYTES = 1 << 20  # a few hundred rules at most; anything larger is not a key map


def read_key_map(path: Path) -> list[KeyMapRule]:
    if not path.exists():
        raise KeyMapError(f"{path}: no such key-map file")
    if not path.is_file():  # a directory, or a FIFO that would block the read
        raise KeyMapError(f"{path}: not a regular file (a directory, FIFO or device); expected a key-map file")
    if path.stat().st_size > MAX_KEY_MAP_BYTES:
        raise KeyMapError(f"{path}: {path.stat().st_size} bytes, more than a key map's {MAX_KEY_MAP_BYTES >> 10} KiB")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KeyMapError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise KeyMapError(f"{path}: unreadable key-map file ({exc.strerror or 'read failed'})") from exc
    rules = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "=>" not in stripped:
            raise KeyMapError(f"{path}:{number}: expected 'PATTERN => REPLACEMENT', got {stripped[:80]!r}")
        pattern, replacement = (part.strip() for part in stripped.split("=>", 1))
        try:
            rules.append(KeyMapRule(re.compile(pattern), replacement, number))
        except re.error as exc:
            raise KeyMapError(f"{path}:{number}: invalid pattern {pattern!r} ({exc})") from exc
    return rules


def apply_rules(name: str, rules: list[KeyMapRule], source: str) -> str:
    for rule in rules:
        try:
            name = rule.pattern.sub(rule.replacement, name)
        except (re.error, IndexError) as exc:
            raise KeyMapError(f"{source}:{rule.line}: replacement fails on {name!r} ({exc})") from exc
    return name


@dataclass
class NameMapping:
    """raw name -> canonical name for every tensor read; `unmapped` lists those that map to nothing."""

    scheme: str  # "canonical", "canonical behind wrapper prefixes", "--key-map FILE"
    renamed: dict[str, str] = field(default_factory=dict)  # raw -> final name (canonical or not)

    @property
    def unmapped(self) -> list[str]:
        return [raw for raw, name in self.renamed.items() if not is_canonical(name)]


def looks_known(names: list[str]) -> bool:
    """A DFlash drafter body in canonical names: fc plus at least one canonical layer tensor."""
    return "fc.weight" in names and any(LAYER_NAME.match(n) and is_canonical(n) for n in names)


def map_names(raw_names: list[str], rules: list[KeyMapRule] | None, map_source: str = "--key-map") -> NameMapping:
    """Canonical names for `raw_names`; None when no known scheme fits and no rules were given."""
    if rules is not None:
        renamed = {raw: strip_prefixes(apply_rules(raw, rules, map_source)) for raw in raw_names}
        scheme = f"--key-map {map_source}"
    else:
        renamed = {raw: strip_prefixes(raw) for raw in raw_names}
        if not looks_known(list(renamed.values())):
            return None
        scheme = "canonical" if all(raw == name for raw, name in renamed.items()) else \
            "canonical behind wrapper prefixes"
    collisions: dict[str, list[str]] = {}
    for raw, name in renamed.items():
        collisions.setdefault(name, []).append(raw)
    clash = next((raws for raws in collisions.values() if len(raws) > 1), None)
    if clash:
        raise KeyMapError(f"tensors {clash[0]!r} and {clash[1]!r} both map to {renamed[clash[0]]!r}; "
                          "pick one with --ours-entry/--entry or a --key-map")
    return NameMapping(scheme, renamed)


# -- proposing a map for an unknown scheme --------------------------------------------------
TOKEN_HINTS = {
    "self_attn.q_proj": {"q", "wq", "query", "q_proj"}, "self_attn.k_proj": {"k", "wk", "key", "k_proj"},
    "self_attn.v_proj": {"v", "wv", "value", "v_proj"},
    "self_attn.o_proj": {"o", "wo", "out", "o_proj", "out_proj", "dense", "output"},
    "mlp.gate_proj": {"gate", "w1", "gate_proj"}, "mlp.up_proj": {"up", "w3", "up_proj"},
    "mlp.down_proj": {"down", "w2", "down_proj"},
    "self_attn.q_norm": {"q", "qnorm", "q_norm", "query"}, "self_attn.k_norm": {"k", "knorm", "k_norm", "key"},
    "input_layernorm": {"input", "ln1", "norm1", "attn", "attention", "pre", "ln_1"},
    "post_attention_layernorm": {"post", "ln2", "norm2", "mlp", "ffn", "ln_2"},
    "hidden_norm": {"hidden", "context", "ctx", "feat", "feature", "features", "target", "fc", "input", "proj"},
    "norm": {"final", "out", "output", "ln_f", "last"},
}


def tokens_of(name: str) -> set[str]:
    parts = re.split(r"[._]", name.lower())
    joined = {f"{a}_{b}" for a, b in zip(parts, parts[1:])}
    return (set(parts) | joined) - {"weight", "bias", ""}


def _pick(candidates: list[str], tokens: set[str]) -> str | None:
    scored = sorted(((len(TOKEN_HINTS[c] & tokens), c) for c in candidates), reverse=True)
    if not scored or scored[0][0] == 0 or (len(scored) > 1 and scored[0][0] == scored[1][0]):
        return None
    return scored[0][1]


def classify(name: str, shape: tuple[int, ...], hidden: int) -> str | None:
    """The canonical name (with layer index placeholder `{i}`) a tensor most likely is."""
    tokens = tokens_of(name)
    layered = re.search(r"(?:^|[._])(\d+)(?:[._]|$)", name) is not None
    kind = "bias" if name.endswith("bias") else "weight"
    if not layered:
        if len(shape) == 2 and shape[0] == hidden and shape[1] % hidden == 0:
            return "fc.weight" if shape[1] != hidden or "fc" in tokens or "proj" in tokens else None
        if len(shape) == 1 and shape[0] == hidden:
            picked = _pick(["hidden_norm", "norm"], tokens)
            return f"{picked}.weight" if picked else None
        return None
    if len(shape) == 2:
        candidates = []
        if shape[1] == hidden:  # reads the hidden state: q, k, v, gate, up
            candidates += ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
        if shape[0] == hidden:  # writes it: o, down
            candidates += ["self_attn.o_proj", "mlp.down_proj"]
        picked = _pick(candidates, tokens)
        return f"layers.{{i}}.{picked}.{kind}" if picked else None
    if len(shape) == 1:
        if shape[0] == hidden:
            picked = _pick(["input_layernorm", "post_attention_layernorm"], tokens)
        else:
            picked = _pick(["self_attn.q_norm", "self_attn.k_norm"], tokens)
        return f"layers.{{i}}.{picked}.weight" if picked else None
    return None


def propose_key_map(shapes: dict[str, tuple[int, ...]]) -> str:
    """A --key-map file (text) for these tensors, from name tokens and shapes; unplaced names as comments."""
    sizes = Counter(s[0] for s in shapes.values() if len(s) == 1)
    hidden = sizes.most_common(1)[0][0] if sizes else -1
    rules: list[str] = []
    unplaced: list[str] = []
    for name, shape in sorted(shapes.items()):
        canonical = classify(name, tuple(shape), hidden)
        if canonical is None:
            unplaced.append(f"# ? {name} {list(shape)}: no canonical name found; add a rule or leave it unmapped")
            continue
        match = re.search(r"(?:^|[._])(\d+)(?=[._]|$)", name)
        if "{i}" in canonical and match:
            start, end = match.span(1)
            pattern = "^" + re.escape(name[:start]) + r"(\d+)" + re.escape(name[end:]) + "$"
            rule = f"{pattern} => {canonical.replace('{i}', chr(92) + '1')}"
        else:
            rule = f"^{re.escape(name)}$ => {canonical}"
        if rule not in rules:
            rules.append(rule)
    header = ["# dflash-audit proposed key map: PATTERN => REPLACEMENT (Python re.sub), applied in order.",
              "# Built from name tokens and shapes; check every line before passing it with --key-map."]
    return "\n".join(header + rules + unplaced) + "\n"
