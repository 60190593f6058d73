"""Runs inside vLLM's own environment (`.venv-vllm/bin/python hidden_states_driver.py REQUEST.json`): the target's
hidden states through vLLM's `extract_hidden_states` speculative method. Imports only vLLM, torch, safetensors and the
standard library.

Per prompt, two requests to one engine: the greedy continuation, then the prompt and continuation prefilled with
`max_tokens=1` and the top-2 prompt logprobs (each position's top-1 minus top-2 logit, the offline cache's margin).
The second request's states are the ones the `extract_hidden_states` proposer receives from the target
(`ExtractHiddenStatesProposer.propose`, vllm/v1/spec_decode/extract_hidden_states.py: the aux layers vLLM captures with
`_maybe_add_hidden_state`, stacked [T, L, H]), written as vLLM's `ExampleHiddenStatesConnector` writes them: one
safetensors file per prompt, `hidden_states` [T, L, H] and `token_ids` [T].

- With `"connector": true` (a GPU), the connector writes the file itself (`kv_transfer_config`, as speculators'
  launch script sets it) and it is read back with vLLM's own `load_hidden_states`.
- On a CPU the connector cannot write: `_submit_async_write` copies the states into pinned host memory
  (`torch.empty_like(..., pin_memory=True)`, example_hidden_states_connector.py:402), which torch refuses without an
  accelerator ("pin_memory=True requires a CUDA or other accelerator backend"). There the same stacked tensor is
  taken where the live check takes a drafter's inputs (serving_engines/live/engine_driver.py `Capture`): at the
  proposer's `propose`, the target's aux states as the runner hands them over, and written in the connector's format.

The final-norm output of the last layer (what the offline cache keeps for the last layer) is vLLM's own final norm
(`model.model.norm`) applied to the captured last layer: written beside, in `normed/`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: the wrap reaches it


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def save_atomic(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


class ProposerCapture:
    """The stacked aux states the target hands the extract_hidden_states proposer, step by step."""

    def __init__(self, runner):
        self.proposer, self.rows, self.on = runner.drafter, [], False
        self.original = self.proposer.propose

        def propose(num_speculative_tokens, sampled_token_ids, target_hidden_states, *args, **kwargs):
            if self.on:
                import torch

                self.rows.append(torch.stack(target_hidden_states, dim=1).detach().cpu().clone())
            return self.original(num_speculative_tokens, sampled_token_ids, target_hidden_states, *args, **kwargs)

        self.proposer.propose = propose

    def remove(self):
        del self.proposer.propose  # the instance attribute: the class's method again


def margins(output) -> list[float]:
    """Top-1 minus top-2 logprob (= logit) at each position: the prompt's from its prompt logprobs (position t - 1
    predicts token t), the last from the sampled token's logprobs."""
    found = []
    for entry in list(output.prompt_logprobs[1:]) + [output.outputs[0].logprobs[0]]:
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        found.append(values[0] - values[1])
    return found


def main() -> int:
    import torch
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(request["out"])
    connector = bool(request.get("connector"))
    staging = out / "connector"
    kwargs = dict(model=request["target"], dtype=request["dtype"], enforce_eager=True,
                  max_model_len=request["max_model_len"], seed=0, enable_prefix_caching=False,
                  tensor_parallel_size=request.get("tensor_parallel_size", 1),
                  speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {
                                          "eagle_aux_hidden_state_layer_ids": request["depths"]}}})
    if connector:
        kwargs["kv_transfer_config"] = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"shared_storage_path": str(staging)}}
    started = time.monotonic()
    llm = LLM(**kwargs)
    load_s = time.monotonic() - started
    runner = runner_of(llm)
    capture = None if connector else ProposerCapture(runner)
    greedy = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                            stop_token_ids=list(request["stop_ids"]), ignore_eos=True)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=2, ignore_eos=True)
    norm = runner.model.model.norm
    records = []
    t0 = time.monotonic()
    for index, prompt in enumerate(request["prompts"]):
        (generated,) = llm.generate([TokensPrompt(prompt_token_ids=prompt["ids"])], greedy, use_tqdm=False)
        tokens = list(prompt["ids"]) + list(generated.outputs[0].token_ids)
        if capture is not None:
            capture.rows, capture.on = [], True
        (filled,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], prefill, use_tqdm=False)
        path = out / f"{index}.safetensors"
        if capture is not None:
            capture.on = False
            hidden = torch.cat(capture.rows)[: len(tokens)]  # the prefill's rows (the one decode step's after)
            save_atomic({"hidden_states": hidden, "token_ids": torch.tensor(tokens)}, path)
        else:
            from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
                load_hidden_states)

            written = filled.kv_transfer_params["hidden_states_path"]
            while not Path(written).is_file() and llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.step()  # the connector writes once a later step reports the request finished
            for _ in range(100):  # a last step or two (no request left) flushes the connector's write
                if Path(written).is_file():
                    break
                llm.llm_engine.step()
            data = load_hidden_states(written)
            save_atomic(data, path)
            hidden = data["hidden_states"]
        with torch.inference_mode():
            last = hidden[:, -1].to(next(runner.model.parameters()).device, next(runner.model.parameters()).dtype)
            normed = norm(last)
            normed = normed[0] if isinstance(normed, tuple) else normed
        (out / "normed").mkdir(exist_ok=True)
        save_atomic({"normed": normed.float().cpu()}, out / "normed" / path.name)
        records.append({"id": prompt["id"], "file": path.name, "prompt_len": len(prompt["ids"]),
                        "margin": margins(filled)})
    if capture is not None:
        capture.remove()
    result = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "python": sys.executable,
              "path": "connector" if connector else "proposer capture (no pinned memory on a CPU)",
              "load_s": load_s, "generate_s": time.monotonic() - t0, "records": records}
    tmp = out / ".driver.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / "driver.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
