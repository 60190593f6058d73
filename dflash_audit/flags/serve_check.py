"""`serve-check`'s flags, declared once (`ServeCheckFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import model_validator

from serving_engines.live.llamacpp_convert import QUANT_TYPES
from dflash_audit.flags import Engines, VerbFlags, flag, force_flag, max_new_tokens_flag, tau_bin_flag


DEFAULT_SAMPLES = 8  # --live --temperature > 0: seeded generations per prompt (seeds 0..N-1)


class ServeCheckFlags(VerbFlags):
    """`serve-check`'s flags."""

    drafter: Path = flag(..., help="drafter directory (z-lab or speculators format)")
    engine: Engines = flag("vllm,sglang", cli=str, help="engines to hold it against: a comma list of vllm, sglang, "
                                                        "llamacpp")
    target: Path | None = flag(None, help="target HF dir: its layers, vocabulary, eos/pad")
    spec: list[str] = flag([], help="KEY=VALUE trained spec field (repeatable)")
    json_path: Path | None = flag(None, "--json", help="write the JSON here")
    out: Path | None = flag(None, help="report dir: serving.json + index.html")
    live: bool = flag(False, help="also run it in a real engine (vllm, llamacpp), round by round")
    prompts: Path | None = flag(None, help="--live: prompts JSONL (default: built-in)")
    max_new_tokens: int = max_new_tokens_flag(64, "--live: tokens per prompt.")
    tau_bin_tokens: int = tau_bin_flag()
    vllm_python: Path | None = flag(None, help="--live: a Python with vLLM (default .venv-vllm/bin/python)")
    temperature: float = flag(0.0, ge=0, le=100.0, allow_inf_nan=False,
                              help="vllm --live: > 0 serves at this temperature, the drafts sampled "
                                   "(draft_sample_method probabilistic), τ held to the audit's sampled prediction")
    samples: int | None = flag(None, ge=2, le=256, help=f"--live --temperature > 0: seeded generations per prompt "
                                                        f"(seeds 0..N-1; default {DEFAULT_SAMPLES})")
    force: bool = force_flag("report files")
    n_max: int | None = flag(None, "--spec-draft-n-max", ge=1,
                             help="llamacpp: the llama-server --spec-draft-n-max you run (default: block - 1, and its "
                                  "absence flagged)")
    kv_type: str | None = flag(None, "--draft-kv-type", help="llamacpp: the draft KV cache type you run")
    quant: Literal[QUANT_TYPES] | None = flag(None, help="llamacpp --live: serve the drafter quantized")
    llamacpp_bin: Path | None = flag(None, help="llamacpp --live: a folder with your own llama-server build")

    @model_validator(mode="after")
    def live_rules(self) -> ServeCheckFlags:
        if self.quant is not None and not self.live:
            raise ValueError("--quant applies to --live (the quantized drafter is served and held to its training)")
        if self.live and (self.target is None or not {"vllm", "llamacpp"} & set(self.engine)):
            raise ValueError("--live runs the drafter in vLLM or llama.cpp on the target: give --target and keep "
                             "vllm or llamacpp in --engine")
        if self.temperature > 0 and not (self.live and "vllm" in self.engine and "llamacpp" not in self.engine):
            raise ValueError("--temperature > 0 applies to vLLM's live run (give --live, and vllm without llamacpp "
                             "in --engine: llama.cpp's live check is greedy only)")
        if self.samples is not None and self.temperature == 0:
            raise ValueError("--samples applies to --temperature > 0 (greedy runs each prompt once)")
        return self

    def sample_count(self) -> int:
        return DEFAULT_SAMPLES if self.samples is None else self.samples
