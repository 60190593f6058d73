"""The four τ methods by name (`--tau-method`): ours (impl/tau_methods.py: `live`, `teacher-forced`) and z-lab's
(reference_adapters/zlab_benchmark.py: `zlab-loop`, `zlab-benchmark`); what each can run."""

from __future__ import annotations

import torch

from foundation.benchmarks.sets import PromptSet
from foundation.chat_template import ChatTemplate
from foundation.errors import AuditError
from impl.tau_methods import Setting, mean_tau

TAU_METHODS = ("live", "zlab-loop", "teacher-forced", "zlab-benchmark")
__all__ = ["TAU_METHODS", "Setting", "check_method", "mean_tau", "run_method"]


def check_method(method: str, setting: Setting) -> None:
    if method not in TAU_METHODS:
        raise AuditError(f"--tau-method must be one of {list(TAU_METHODS)}, got {method!r}")
    if setting.temperature > 0 and method == "teacher-forced":
        raise AuditError(f"--tau-method {method} is greedy by definition (it never samples); use live or zlab-loop "
                         "at --temperature > 0")
    if setting.decode == "ddtree" and method in ("zlab-loop", "zlab-benchmark"):
        raise AuditError(f"--tau-method {method} runs z-lab's dflash_generate, which has no tree (DDTree: live or "
                         "teacher-forced)")
    if setting.decode == "ddtree" and setting.temperature > 0:
        raise AuditError("--temperature > 0 needs --method dflash (DDTree is greedy)")


def run_method(method: str, drafter, target, tokenizer, prompt_set: PromptSet, template: ChatTemplate,
               setting: Setting) -> list[dict]:
    """Per-response results `{"id", "prompt", "turn", "prompt_tokens", "rounds", "tau"}` of `method`."""
    check_method(method, setting)
    # The runners (and z-lab's package) are imported when a method runs, not when eval checks its flags.
    from impl.tau_methods import RUNNERS
    from reference_adapters.zlab_benchmark import zlab_benchmark, zlab_loop

    runners = {**RUNNERS, "zlab-loop": zlab_loop, "zlab-benchmark": zlab_benchmark}
    with torch.inference_mode():
        return runners[method](drafter, target, tokenizer, prompt_set, template, setting)
