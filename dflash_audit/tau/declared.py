"""The chat-template settings a drafter declares it was trained with, and the finding when an evaluation differs.

A drafter trained on prompts rendered with thinking off and evaluated with thinking on accepts far
less (z-lab/dflash #133: 25% against 60%), with nothing wrong in the checkpoint. Where the settings
are declared: `chat_template_kwargs` (or a bare `enable_thinking`) in the drafter's config.json, at
the top or inside `dflash_config` / `speculators_config`; or given with `--trained-chat-template-kwargs`.
"""

from __future__ import annotations

from catalogue.findings import Finding
from foundation.chat_template import parse_kwargs

SECTIONS = ("dflash_config", "speculators_config")


def _from_mapping(config: dict) -> dict | None:
    if isinstance(config.get("chat_template_kwargs"), dict):
        return dict(config["chat_template_kwargs"])
    if isinstance(config.get("enable_thinking"), bool):
        return {"enable_thinking": config["enable_thinking"]}
    return None


def declared_settings(raw_config: dict | None, flag_json: str | None = None) -> tuple[dict | None, str]:
    """(settings, where declared) -- the flag wins; (None, "") when nothing declares them."""
    if flag_json is not None:
        return parse_kwargs(flag_json), "--trained-chat-template-kwargs"
    if not isinstance(raw_config, dict):
        return None, ""
    found = _from_mapping(raw_config)
    if found is not None:
        return found, "config.json"
    for section in SECTIONS:
        if isinstance(raw_config.get(section), dict):
            found = _from_mapping(raw_config[section])
            if found is not None:
                return found, f"config.json {section}"
    return None, ""


def template_findings(declared: dict | None, where: str, evaluated: dict[str, dict]) -> list[Finding]:
    """One finding per chat setting evaluated with other values than the declared ones (its key: the setting)."""
    if declared is None:
        return []
    findings = []
    for label, kwargs in evaluated.items():
        differ = {k: (v, kwargs.get(k)) for k, v in declared.items() if kwargs.get(k) != v}
        if differ:
            text = ", ".join(f"{k}: trained {a!r}, evaluated {b!r}" for k, (a, b) in differ.items())
            findings.append(Finding("chat_template", "divergence",
                                    f"the drafter declares its training chat-template settings ({where}) and this "
                                    f"evaluation ({label}) uses others: {text}; τ measured here is not the τ it was "
                                    "trained for (z-lab/dflash #133)",
                                    {k: a for k, (a, _) in differ.items()}, {k: b for k, (_, b) in differ.items()},
                                    key=label))
    return findings
