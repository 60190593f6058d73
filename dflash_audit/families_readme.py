"""The families table of README.md and docs/families.md, generated from one declaration: for each DFlash-family
drafter (rows) and each codebase (columns), whether the tool holds that codebase's drafter of that family to the
references, and the test that backs the mark.

- ✓: the codebase has the family and the named test holds it (ours and the references: decoding, τ, formats;
  held trainers: their conformance run; engines: `serve-check`);
- —: the codebase has the family and the tool does not hold it yet;
- n/a: the codebase has no such family.

`python -m dflash_audit.families_readme` prints both tables; tests/test_families_table.py keeps README.md and
docs/families.md equal to them, checks every named test exists, and checks every — and n/a against the installed
packages.
"""

from __future__ import annotations

from dataclasses import dataclass

from impl.families import FAMILIES, TITLES

CODEBASES = ("ours", "speculators", "z-lab", "Model-Optimizer", "SpecForge", "vLLM", "SGLang")
HELD, NA, NOT_HELD = "✓", "n/a", "—"
# The test that checks each — and n/a against the installed package (tests/test_families_table.py).
FACTS = "tests/test_families_table.py::test_each_dash_and_na_is_what_the_installed_codebase_has"

SERVING = "tests/test_serving.py::test_each_writer_serves_with_exactly_the_known_divergences"
FAMILY = "tests/test_family_drafters.py"
ZLAB_REFUSED = f"{FAMILY}::test_convert_to_ours_and_back_is_exact_and_zlab_is_refused"
TAU = f"{FAMILY}::test_tau_per_prompt_equals_speculators_own_model_live_and_offline"
DFLASH2_READ = "tests/test_dflash2_formats.py::test_each_reference_loads_our_dflash2_directories_with_their_own_from_pretrained"


@dataclass(frozen=True)
class Cell:
    mark: str
    test: str  # `path::test_name`: the test that backs the mark


TABLE: dict[str, dict[str, Cell]] = {
    "dflash": {
        "ours": Cell(HELD, "conformance/test_live_decoding.py::test_per_round_acceptance_and_tau_p17"),
        "speculators": Cell(HELD, "tests/test_adapters.py::test_adapters_call_the_packages"),
        "z-lab": Cell(HELD, "tests/test_adapters.py::test_zlab_generate_runs_on_cpu_and_is_lossless"),
        "Model-Optimizer": Cell(HELD, "tests/test_modelopt_golden.py::test_modelopt_fails_exactly_its_known_divergences"),
        "SpecForge": Cell(HELD, "tests/test_specforge_golden.py::test_specforge_fails_exactly_its_known_divergences"),
        "vLLM": Cell(HELD, SERVING),
        "SGLang": Cell(HELD, SERVING),
    },
    "dflash2": {
        "ours": Cell(HELD, "conformance/test_conv.py::test_dflash2_draft_forward_identical_weights_p22"),
        "speculators": Cell(HELD, DFLASH2_READ),
        "z-lab": Cell(HELD, DFLASH2_READ),
        "Model-Optimizer": Cell(NA, FACTS),
        "SpecForge": Cell(NA, FACTS),
        "vLLM": Cell(HELD, SERVING),
        "SGLang": Cell(HELD, SERVING),
    },
    "dspark": {
        "ours": Cell(HELD, TAU),
        "speculators": Cell(HELD, "conformance/test_dspark_heads.py::test_markov_and_confidence_heads_p37"),
        "z-lab": Cell(NA, ZLAB_REFUSED),
        "Model-Optimizer": Cell(HELD, "tests/test_modelopt_golden.py::test_the_run_held_modelopt_only"),
        "SpecForge": Cell(NOT_HELD, FACTS),
        "vLLM": Cell(HELD, f"{FAMILY}::test_serve_check_dspark_vllm_serves_the_vanilla_markov_head_only"),
        "SGLang": Cell(NOT_HELD, FACTS),
    },
    "xpress": {
        "ours": Cell(HELD, TAU),
        "speculators": Cell(HELD, "conformance/test_xpress_refiner.py::test_jacobi_resolution_p38"),
        "z-lab": Cell(NA, ZLAB_REFUSED),
        "Model-Optimizer": Cell(NA, FACTS),
        "SpecForge": Cell(NA, FACTS),
        "vLLM": Cell(HELD, f"{FAMILY}::test_serve_check_xpress_vllm_refuses_it_and_reads_other_names"),
        "SGLang": Cell(NA, FACTS),
    },
}
assert tuple(TABLE) == FAMILIES and all(tuple(row) == CODEBASES for row in TABLE.values())


def markdown(with_tests: bool = False) -> str:
    """The README's table (marks), or docs/families.md's (each mark with its test)."""
    lines = ["| | " + " | ".join(CODEBASES) + " |", "|---|" + "---|" * len(CODEBASES)]
    for family, row in TABLE.items():
        cells = [f"{c.mark} `{c.test}`" if with_tests else c.mark for c in row.values()]
        lines.append(f"| {TITLES[family]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), markdown(with_tests=True), sep="\n", end="")
