"""Runs inside vLLM's own environment (`.venv-vllm/bin/python engine_driver.py REQUEST.json`): the live check's
engine side. Imports only vLLM, torch and the standard library: the audit's code never runs in this process.

The request names one target, the prompts (token ids), and the engine runs to make: the target alone (greedy
reference) and each drafter, optionally with planted engine-side bugs. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the drafter's inputs and module outputs are captured by wrapping
`DFlashProposer.propose` and forward hooks on the drafter's modules. Per run it writes
`<out>/<run>.json` (rounds, drafts, output ids) and `<out>/<run>.safetensors` (captured tensors of every round),
each atomically; `<out>/driver.json` last, so the caller reads nothing half-written.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: hooks reach it


def atomic_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def runner_of(llm):
    """The engine core's model runner (in-process engine core, one worker)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class Capture:
    """Per `propose` call (one engine step): the drafter's inputs, its module outputs and its drafts."""

    def __init__(self, runner):
        self.runner, self.steps, self.handles = runner, [], []
        self.keep_tensors = True

    def install(self):
        proposer = self.runner.drafter
        original = proposer.propose
        model = proposer.model

        def propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                    next_token_ids, *args, **kwargs):
            rejected = kwargs.get("num_rejected_tokens_gpu")
            step = {"context_tokens": target_token_ids.tolist(), "context_positions": target_positions.tolist(),
                    "next_token": next_token_ids.tolist(),
                    "rejected": None if rejected is None else rejected.tolist(), "modules": {}}
            if self.keep_tensors:
                step["tensors"] = {"aux": target_hidden_states.detach().float().clone()}
            self.steps.append(step)
            drafts = original(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                              next_token_ids, *args, **kwargs)
            step["drafts"] = drafts.tolist()
            return drafts

        proposer.propose = propose
        self.handles.append(lambda: setattr(proposer, "propose", original))

        def hook(name):
            def record(module, inputs, output):
                if not self.steps or not self.keep_tensors:
                    return
                value = output
                if isinstance(output, tuple):  # a decoder layer: (hidden, residual) -> the residual stream
                    value = output[0] + output[1] if output[1] is not None else output[0]
                self.steps[-1]["tensors"][name] = value.detach().float().clone()
            return record

        def record_block(module, args, kwargs):
            if not self.steps:
                return
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            self.steps[-1]["block_tokens"] = input_ids.tolist()
            self.steps[-1]["block_positions"] = positions.tolist()

        inner = model.model
        self.handles.append(inner.register_forward_pre_hook(record_block, with_kwargs=True).remove)
        self.handles.append(inner.fc.register_forward_hook(hook("fc")).remove)
        for i, layer in enumerate(inner.layers):
            self.handles.append(layer.register_forward_hook(hook(f"layers.{i}")).remove)
        self.handles.append(inner.norm.register_forward_hook(hook("norm")).remove)
        original_context = inner.precompute_and_store_context_kv

        def context_kv(context_states, context_positions, *args, **kwargs):
            if self.steps and self.keep_tensors:
                self.steps[-1]["tensors"]["context"] = context_states.detach().float().clone()
            return original_context(context_states, context_positions, *args, **kwargs)

        inner.precompute_and_store_context_kv = context_kv
        self.handles.append(lambda: setattr(inner, "precompute_and_store_context_kv", original_context))

    def remove(self):
        for undo in reversed(self.handles):
            undo()
        self.handles = []


# -- planted engine-side bugs (the live check's proof, tests/test_live_planted.py) -------------------------------
@contextmanager
def planted(runner, bug: str | None):
    """Apply one engine-side bug to the loaded engine, undone on exit."""
    if bug is None:
        yield
        return
    proposer = runner.drafter
    inner = proposer.model.model
    undo = []
    if bug == "norm_swap":  # the input norm weights of draft layers 0 and 1 exchanged
        a, b = inner.layers[0].input_layernorm.weight, inner.layers[1].input_layernorm.weight
        saved = a.data.clone()
        a.data.copy_(b.data)
        b.data.copy_(saved)
        undo.append(lambda: (b.data.copy_(a.data), a.data.copy_(saved)))
    elif bug in ("layer_shift", "last_before_norm"):
        target = runner.model.model
        layers = tuple(target.aux_hidden_state_layers)
        if bug == "layer_shift":  # the first captured layer one lower
            changed = (layers[0] - 1, *layers[1:])
            target.aux_hidden_state_layers = changed
            undo.append(lambda: setattr(target, "aux_hidden_state_layers", layers))
        else:  # the final layer's capture, after the final norm (as training reads it) -> before it, and back
            yield_fix = runner.model.model.norm
            undo.append(lambda: None)
            del yield_fix
    elif bug == "mask_id":  # the block's mask slots filled with another token
        saved_id = proposer.parallel_drafting_token_id
        proposer.parallel_drafting_token_id = saved_id - 1
        undo.append(lambda: setattr(proposer, "parallel_drafting_token_id", saved_id))
    elif bug == "draft_length":  # every block drafted one token short
        original = proposer.propose

        def shorter(num_speculative_tokens, *args, **kwargs):
            return original(num_speculative_tokens - 1, *args, **kwargs)

        proposer.propose = shorter
        undo.append(lambda: setattr(proposer, "propose", original))
    else:
        raise ValueError(f"unknown planted bug {bug!r}")
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def generate(llm, prompts, max_new_tokens, stop_ids):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                            ignore_eos=not stop_ids)
    outputs = []
    for prompt in prompts:  # one request at a time: batch 1, as the audit decodes
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt["ids"])], params, use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    return outputs


def save_steps(path: Path, per_prompt_steps) -> dict:
    """Tensors to `<path>` (safetensors, atomically); the steps' other fields returned, tensors named."""
    from safetensors.torch import save_file

    tensors, meta = {}, []
    for p, steps in enumerate(per_prompt_steps):
        rows = []
        for s, step in enumerate(steps):
            names = {}
            for name, value in step.pop("tensors", {}).items():
                key = f"p{p}.s{s}.{name}"
                tensors[key] = value.contiguous()
                names[name] = key
            rows.append({**step, "tensors": names})
        meta.append(rows)
    if tensors:
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
    return meta


def run_one(spec, request, out: Path) -> dict:
    from vllm import LLM

    kwargs = dict(model=request["target"], dtype=request["dtype"], enforce_eager=True,
                  max_model_len=request["max_model_len"], seed=0, async_scheduling=False,
                  enable_prefix_caching=False)
    if spec.get("drafter"):
        kwargs["speculative_config"] = {"method": "dflash", "model": spec["drafter"],
                                        "num_speculative_tokens": spec["num_speculative_tokens"]}
    started = time.monotonic()
    llm = LLM(**kwargs)
    load_s = time.monotonic() - started
    result = {"name": spec["name"], "load_s": load_s, "variants": {}}
    try:
        runner = runner_of(llm) if spec.get("drafter") else None
        for bug in [None, *spec.get("plants", [])]:
            label = bug or "served"
            prompts = request["prompts"] if bug is None else request["prompts"][: spec.get("plant_prompts", 1)]
            capture = None
            if runner is not None:
                capture = Capture(runner)
                capture.keep_tensors = spec.get("capture", True)
            per_prompt_steps, outputs = [], []
            t0 = time.monotonic()
            with planted(runner, bug):
                if capture is not None:
                    capture.install()
                try:
                    for prompt in prompts:
                        if capture is not None:
                            capture.steps = []
                        outputs += generate(llm, [prompt], request["max_new_tokens"], request["stop_ids"])
                        per_prompt_steps.append(capture.steps if capture is not None else [])
                finally:
                    if capture is not None:
                        capture.remove()
            tensors_file = out / f"{spec['name']}.{label}.safetensors"
            meta = save_steps(tensors_file, per_prompt_steps)
            result["variants"][label] = {"outputs": outputs, "steps": meta, "generate_s": time.monotonic() - t0,
                                         "tensors": tensors_file.name if tensors_file.exists() else None}
    finally:
        del llm
        gc.collect()
    return result


def refusal(exc: Exception) -> str:
    """The engine's own words: a config validation error's message, else the exception's first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return str(errors()[0]["msg"]).removeprefix("Value error, ")
        except Exception:  # noqa: BLE001 -- not pydantic's: fall back to the text
            pass
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(request["out"])
    import resource

    import torch
    import vllm

    torch.manual_seed(0)
    runs = []
    for spec in request["runs"]:
        try:
            runs.append(run_one(spec, request, out))
        except Exception as exc:  # noqa: BLE001 -- the engine's own refusal, one line, passed to the report
            import traceback

            traceback.print_exc()  # the whole story stays in the engine log
            runs.append({"name": spec["name"], "error": refusal(exc)})
    atomic_json(out / "driver.json", {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
                                      "python": sys.executable, "runs": runs,
                                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    return 0


if __name__ == "__main__":
    sys.exit(main())
