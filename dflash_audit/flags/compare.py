"""`compare`'s flags, declared once (`CompareFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import model_validator

from dflash_audit.flags import (
    CHAT_TEMPLATE_HELP,
    DEVICE_HELP,
    DEVICE_MAP_HELP,
    DTYPE_HELP,
    ChatKwargs,
    Device,
    Dtypes,
    Engines,
    VerbFlags,
    budget_flag,
    flag,
    force_flag,
    max_new_tokens_flag,
    tau_bin_flag,
)


class CompareFlags(VerbFlags):
    """`compare`'s flags."""

    ours: Path = flag(..., help="our drafter: ckpt.pt, z-lab dir or speculators dir")
    ref: Path = flag(..., help="the reference drafter, any format")
    target: Path | None = flag(None, help="target HF dir: enables the τ audit")
    prompts: Path | None = flag(None, help="prompts JSONL (default: built-in)")
    static_only: bool = flag(False, help="skip the τ audit")
    out: Path | None = flag(None, help="report dir (default reports/<ours>-vs-<ref>/)")
    json_path: Path | None = flag(None, "--json", help="also write report.json here")
    expect_identical: bool = flag(False, help="any weight difference is a divergence")
    max_new_tokens: int = max_new_tokens_flag(64)
    budget: int = budget_flag(32)
    tau_bin_tokens: int = tau_bin_flag()
    ours_entry: str | None = flag(None, help="entry of a training dict holding our state dict")
    ref_entry: str | None = flag(None, help="same, for --ref")
    key_map: Path | None = flag(None, "--key-map", "--ours-key-map",
                                help="our parameter names: 'PATTERN => REPLACEMENT' per line")
    ref_key_map: Path | None = flag(None, help="same, for --ref")
    ours_spec: list[str] = flag([], help="KEY=VALUE spec/recipe field (repeatable)")
    ref_spec: list[str] = flag([], help="same, for --ref")
    truncate: bool = flag(False, help="keep a too-long prompt's last tokens (default: refuse it)")
    serve: Engines | None = flag(None, cli=str | None, help="also check how each drafter would be served: a comma "
                                 "list of vllm, sglang, llamacpp")
    live: bool = flag(False, help="with --serve vllm or llamacpp: run both drafters in a real engine")
    vllm_python: Path | None = flag(None, help="--live: a Python with vLLM (default .venv-vllm/bin/python)")
    cache_dir: Path | None = flag(None, help="cache root; hidden states go to <root>/offline "
                                             "(default $XDG_CACHE_HOME/dflash-audit)")
    device: Device = flag("auto", help=DEVICE_HELP)
    dtype: Dtypes = flag("auto", cli=str, help=DTYPE_HELP + "; a comma list (bfloat16,float32) measures τ in each")
    device_map: Literal["auto"] | None = flag(None, help=DEVICE_MAP_HELP)
    chat_template: str = flag("auto", help=CHAT_TEMPLATE_HELP)
    chat_template_kwargs: ChatKwargs = flag({}, cli=str | None,
                                            help='JSON for apply_chat_template, e.g. {"enable_thinking": false}')
    force: bool = force_flag()
    hidden_states: Literal["transformers", "vllm"] = flag(
        "transformers", help="what makes the offline cache of the target's states: transformers, or vllm (its "
        "extract_hidden_states; --vllm-python names the Python)")
    tensor_parallel_size: int = flag(1, ge=1, help="--hidden-states vllm: vLLM's tensor parallelism (GPUs)")

    @model_validator(mode="after")
    def live_needs_an_engine_and_a_target(self) -> CompareFlags:
        if self.live and (not self.serve or not {"vllm", "llamacpp"} & set(self.serve) or self.target is None):
            raise ValueError("--live runs both drafters in vLLM or llama.cpp on the target: give --serve vllm (or "
                             "llamacpp) and --target")
        if self.hidden_states == "transformers" and self.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size applies to --hidden-states vllm (transformers runs one process: "
                             "--device-map auto shards a large target)")
        if self.hidden_states == "vllm" and self.target is None:
            raise ValueError("--hidden-states vllm makes the target's states: give --target")
        return self

    def load_options(self, side: str):
        """How to read one side (`ours` or `ref`): its entry, key map and spec flags."""
        from dflash_audit.formats import LoadOptions

        if side == "ours":
            return LoadOptions(self.ours_entry, self.key_map, list(self.ours_spec), "--ours")
        return LoadOptions(self.ref_entry, self.ref_key_map, list(self.ref_spec), "--ref")
