"""Small shared builders for the harness's own tests (tiny configs, CPU, seconds)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import warnings

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_world.target_training import random_qwen3
from impl.near_tie import ROUNDING_ULPS
from impl.spec import DraftSpec

# A target state computed in another shape of forward is within this many ulps of its dtype (impl/near_tie.py).
ULPS = ROUNDING_ULPS

# Training text for the tiny worlds: short, repetitive, tokenizer-friendly.
TEXTS = [f"def add_{i}(x, y):\n    total = x + y * {i}\n    return total\n" for i in range(24)]


def tiny_spec(**overrides) -> DraftSpec:
    fields = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=3, target_vocab_size=128, target_layer_ids=(1, 3, 4), num_target_layers=6,
                  mask_token_id=127, block_size=8,
                  layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=6)
    fields.update(overrides)
    return DraftSpec(**fields)


def tiny_target(num_layers: int = 6, hidden: int = 64, vocab: int = 128, seed: int = 0) -> Qwen3ForCausalLM:
    """The harness tests' preset of the one tiny target builder (`dflash_world.target_training.random_qwen3`)."""
    return random_qwen3(num_layers, hidden, vocab, seed)


def zlab_model_for(spec: DraftSpec):
    """z-lab's own DFlashDraftModel (real `dflash` package) for this spec, random weights."""
    from dflash.model import DFlashDraftModel

    from drafter_files.zlab_format import zlab_config

    config = Qwen3Config(**zlab_config(spec))
    config._attn_implementation = "sdpa"
    return DFlashDraftModel(config).eval()


def world_drafter(world, layer_ids, seed):
    """An untrained one-layer drafter sized for a world's target (τ is measured, not good)."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_world import mask_token_id
    from impl.model import DFlashDrafter

    config = AutoConfig.from_pretrained(world.target)
    torch.manual_seed(seed)
    return DFlashDrafter(DraftSpec(
        hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_hidden_layers=1, target_vocab_size=config.vocab_size,
        target_layer_ids=layer_ids, num_target_layers=config.num_hidden_layers,
        mask_token_id=mask_token_id(AutoTokenizer.from_pretrained(world.target)), block_size=8))


def compare_on_world(world, tmp_path, ours, ref, out, max_new_tokens: int, budget: int, recipe=None, **flags):
    """Save `ours` as ckpt.pt (with `recipe`) and `ref` as a z-lab dir, then `compare` them on the world (`flags`:
    more of compare's flags)."""
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.flags.compare import CompareFlags
    from dflash_world.suite_placement import audit_device
    from drafter_files.checkpoint import save_checkpoint
    from drafter_files.zlab_format import save_zlab_dir

    save_checkpoint(tmp_path / "ours.pt", ours, recipe=recipe)
    save_zlab_dir(tmp_path / "ref", ref.spec, ref.state_dict())
    # As `compare --device <the suite's> --dtype auto` places it: the world's target in its declared dtype.
    return run_compare(CompareFlags(ours=tmp_path / "ours.pt", ref=tmp_path / "ref", target=world.target,
                                    prompts=world.prompts, out=out, max_new_tokens=max_new_tokens, budget=budget,
                                    cache_dir=tmp_path / "cache", device=str(audit_device()), **flags))


def load_trained_pair(world, loss: str = "kl_div", family: str = "dflash"):
    """(drafter, target, prompts [(id, ids)], stop ids) of the world and its cached drafter (DFlash, or
    the DFlash2 one), placed by the suite's switch (`DFLASH_AUDIT_DEVICE`, `DFLASH_AUDIT_DTYPE`): the drafter
    built in the target's dtype on its device, as `compare` and `eval` build it."""
    from dflash_audit.prompts import load_prompts, tokenize_prompts
    from dflash_world.drafter import cached_dflash2_drafter, cached_test_drafter
    from dflash_world.suite_placement import audit_placement
    from impl.body_shapes import build_drafter
    from drafter_files.checkpoint import load_checkpoint
    from foundation.placement import built_in
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids

    placement = audit_placement()
    target, tokenizer = load_target(world.target, placement)
    ckpt = load_checkpoint(cached_dflash2_drafter(world) if family == "dflash2" else cached_test_drafter(world, loss))
    drafter = built_in(placement.device, placement.dtype, lambda: build_drafter(ckpt.spec, ckpt.state_dict)).eval()
    prompts = tokenize_prompts(tokenizer, load_prompts(world.prompts))
    return drafter, target, prompts, stop_token_ids(world.target, tokenizer).ids


def cli_in_process(*args) -> subprocess.CompletedProcess:
    """`dflash-audit ARGS` run in this process through the console script's own entry (`dflash_audit.cli.main`):
    its exit status, stdout and stderr as the subprocess would give them, without a new interpreter's imports
    (seconds a call). For tests of what the tool answers, not of process isolation. The warnings it raises are
    printed on its stderr under Python's default filters, as the interpreter would (pytest only records them), so
    a one-line check still counts them."""
    from dflash_audit.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as raised:
        warnings.resetwarnings()  # the interpreter's default filters, not pytest's
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category, append=True)
        warnings.simplefilter("default", append=True)
        status = main(argv)
        for warning in raised:
            print(warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno,
                                         warning.line), end="", file=sys.stderr)
    return subprocess.CompletedProcess(["dflash-audit", *argv], status, out.getvalue(), err.getvalue())


def once_per_session(tmp_path_factory, name: str, build):
    """`build()`'s JSON-able result, built once per test session however many pytest-xdist workers need it: a module
    fixture runs again on every worker that takes one of its tests (work-stealing hands them to both), so an engine
    run would be paid twice. The first worker builds it under a lock in the session's shared temp folder and writes
    its JSON; the others read that. Every worker, the builder too, gets the JSON's reading, so none sees other types."""
    import json
    import os

    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: its own temp folder's parent is not this session's
        return json.loads(json.dumps(build()))
    shared = tmp_path_factory.getbasetemp().parent  # pytest-<n>/, above every worker's popen-gw<i>/
    done = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.is_file():
            part = done.with_suffix(".part")
            part.write_text(json.dumps(build()))
            part.replace(done)
    return json.loads(done.read_text())


def setting_problem(name: str, value) -> str | None:
    """What is wrong with `value` for the drafter setting `name` on its own, by its declaration alone."""
    from impl import settings
    from impl.spec import DraftSpec

    return settings.problem_with(DraftSpec, name, value)


def knob_problem(name: str, value) -> str | None:
    """What is wrong with `value` for the recipe knob `name` on its own, by its declaration alone, or None."""
    from impl import settings
    from impl.recipe import KNOBS, Recipe

    return settings.problem_with(Recipe, name, value) if name in KNOBS else None


@torch.inference_mode()
def greedy_decode(target, input_ids: torch.Tensor, max_new_tokens: int,
                  stop_token_ids: list[int] | None = None) -> torch.Tensor:
    """Plain greedy decoding, one token per target forward: the reference the tests hold speculation's output to."""
    from foundation.transformers_compat import cache_argument
    from impl.decoding import StopTokens, make_target_cache, target_device

    stops = StopTokens(stop_token_ids)
    cache = make_target_cache(target)
    input_ids = input_ids.to(target_device(target))
    tokens = input_ids[0].tolist()
    step_ids = input_ids
    for _ in range(max_new_tokens):
        logits = target(step_ids, **cache_argument(target, cache), use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token in stops.ids:
            break
        step_ids = torch.tensor([[token]], device=input_ids.device)
    return torch.tensor([tokens], device=input_ids.device)


def live_records(section: dict) -> dict:
    """A live section read back from the session's JSON (`once_per_session`) with its localization findings records
    again, as the live check hands them to the report (`serve-check --live` attaches records): each rebuilt from
    `Finding.to_dict`'s words, planted runs too."""
    from catalogue.findings import Finding

    def record(words: dict) -> Finding:
        place = {k: v for k, v in words.items() if k not in ("field", "kind", "what", "message", "size", "source")}
        return Finding("serving", "divergence", words["message"], None, words["size"], key=words["what"],
                       source=words["source"], localized={"kind": words["kind"], **place})

    rebuilt = {**section, "findings": [record(f) for f in section.get("findings", [])]}
    if "planted" in section:
        rebuilt["planted"] = {label: live_records(planted) for label, planted in section["planted"].items()}
    return rebuilt
