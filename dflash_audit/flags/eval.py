"""`eval`'s flags, declared once (`EvalFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from dflash_audit.flags import (
    CHAT_TEMPLATE_HELP,
    DEVICE_HELP,
    DEVICE_MAP_HELP,
    DTYPE_HELP,
    DTYPE_NAMES,
    ChatKwargs,
    Device,
    VerbFlags,
    comma_list,
    flag,
    first_of_each,
    force_flag,
    max_new_tokens_flag,
    tau_bin_flag,
)

# The four τ methods by name (`--tau-method`): ours (impl/tau_methods.py: `live`, `teacher-forced`) and z-lab's
# (reference_adapters/zlab_benchmark.py: `zlab-loop`, `zlab-benchmark`); dflash_audit/tau/grid.py runs them.
TAU_METHODS = ("live", "zlab-loop", "teacher-forced", "zlab-benchmark")
Budget = Annotated[int, Field(ge=1, le=1 << 16)]
Temperature = Annotated[float, Field(ge=0, le=100.0, allow_inf_nan=False)]
Seeds = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(comma_list), AfterValidator(first_of_each),
                  Field(min_length=1)]


class EvalFlags(VerbFlags):
    """`eval`'s flags."""

    drafter: Path = flag(..., help="ours ckpt.pt, z-lab dir or speculators dir")
    target: Path = flag(..., help="Hugging Face target model directory")
    prompts: list[str] = flag(..., min_length=1,
                              help='JSON lines {"id", "prompt"} or {"turns": [...]}, or NAME:PATH, a benchmark\'s own '
                                   "file (gsm8k, math500, aime, humaneval, mbpp, mt-bench, alpaca, livecodebench; "
                                   "JSON lines or parquet); repeatable")
    method: list[Literal["dflash", "ddtree"]] = flag(["dflash"], help="dflash | ddtree (repeatable with --table)")
    budget: list[Budget] = flag([32], help="DDTree node budget, the whole tree verified in one target pass "
                                           "(repeatable with --table)")
    mode: Literal["live", "offline"] = flag("live", help="live | offline (replay from cached hidden states)")
    max_new_tokens: int = max_new_tokens_flag(256)
    temperature: list[Temperature] = flag([0.0], help="> 0: rejection sampling (dflash, live); past 100 sampling is "
                                                      "already uniform; repeatable with --table")
    seed: int = flag(0, ge=0, help="sampling seed when --temperature > 0")
    seeds: Seeds | None = flag(None, cli=str | None, help="comma-separated sampling seeds for the table at T > 0 "
                                                          "(τ per seed and the range across them)")
    json_path: Path | None = flag(None, "--json", help="write the results as JSON here")
    cache_dir: Path | None = flag(None, help="cache root; offline hidden states go to <root>/offline "
                                             "(default $XDG_CACHE_HOME/dflash-audit)")
    chat_template: str = flag("auto", help=CHAT_TEMPLATE_HELP)
    chat_template_kwargs: ChatKwargs = flag({}, cli=str | None,
                                            help='JSON for apply_chat_template, e.g. {"enable_thinking": false}')
    tau_method: list[Literal[TAU_METHODS]] = flag([], help="live | zlab-loop | teacher-forced | zlab-benchmark "
                                                           "(repeatable)")
    tau_by: Literal["thinking"] | None = flag(None, help="thinking: τ with thinking on and off")
    tau_bin_tokens: int = tau_bin_flag()
    table: bool = flag(False, help="τ per set x method x temperature (terminal, --json, --html)")
    html_path: Path | None = flag(None, "--html", help="write the τ table as HTML here")
    max_samples: int | None = flag(None, ge=1, help="prompts per set, chosen by z-lab's seeded selection")
    published: str | None = flag(None, help="set the published figures of this target beside the cells (default: "
                                            "when the target directory is named like one)")
    trained_kwargs: ChatKwargs | None = flag(None, "--trained-chat-template-kwargs", cli=str | None,
                                             help="the chat-template kwargs the drafter was trained with (JSON), "
                                                  "when its config does not declare them")
    entry: str | None = flag(None, help="entry of a training dict holding the state dict")
    key_map: Path | None = flag(None, help="parameter names: 'PATTERN => REPLACEMENT'")
    spec: list[str] = flag([], help="KEY=VALUE spec/recipe field (repeatable)")
    truncate: bool = flag(False, help="keep a too-long prompt's last tokens (default: refuse it)")
    device: Device = flag("auto", help=DEVICE_HELP)
    dtype: Literal[DTYPE_NAMES] = flag("auto", help=DTYPE_HELP)
    device_map: Literal["auto"] | None = flag(None, help=DEVICE_MAP_HELP)
    force: bool = force_flag("a --json or --html file")

    @model_validator(mode="after")
    def rules(self) -> EvalFlags:
        if self.uses_table and self.mode != "live":
            raise ValueError("--mode offline replays plain prompts files; the τ table runs its τ methods "
                             "(--tau-method)")
        sampled = any(t > 0 for t in self.temperature)
        if not self.uses_table and sampled and (self.method[0] == "ddtree" or self.mode == "offline"):
            raise ValueError("--temperature > 0 needs --method dflash --mode live (DDTree and offline replay are "
                             "greedy)")
        return self

    @property
    def uses_table(self) -> bool:
        """Whether eval runs the τ table (`run_table`) rather than one plain prompts file."""
        from foundation.benchmarks.sets import parse_prompts_flag

        many = any(len(values) > 1 for values in (self.prompts, self.method, self.budget, self.temperature))
        named = any(parse_prompts_flag(value)[0] is not None for value in self.prompts)
        return bool(self.table or self.html_path or self.tau_method or self.tau_by or self.max_samples is not None
                    or many or named)

    @property
    def seed_list(self) -> list[int]:
        return self.seeds or [self.seed]

    @property
    def load_options(self):
        from dflash_audit.formats import LoadOptions

        return LoadOptions(self.entry, self.key_map, list(self.spec), flag_prefix="")
