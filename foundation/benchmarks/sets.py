"""Benchmark prompt sets: each set's rows rendered the way the references' benchmark code renders them.

Where z-lab's `dflash.benchmark` has the set (GSM8K, MATH-500, HumanEval, MBPP, MT-Bench) its own
formatter (`DATASETS[name]["format"]`) renders the row, called here, never restated; AIME rows go
through its MATH-500 formatter (the same problem field and instruction, as DFlash's AIME runs use).
Alpaca and LiveCodeBench, which z-lab lacks, are rendered from their own datasets' conventions (see
`RENDERINGS`). Each prompt keeps its reference answer when the set has one: the teacher-forced τ
method (fixed ground truth) walks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from foundation.benchmarks.files import read_rows
from foundation.errors import AuditError


def zlab_datasets() -> dict:
    from dflash.benchmark import DATASETS  # z-lab's formatters, per set

    return DATASETS


@dataclass
class BenchmarkPrompt:
    id: str
    turns: list[str]  # user turns; more than one for MT-Bench
    reference: str | None = None  # the dataset's reference answer (fixed ground truth), if it has one

    @property
    def prompt(self) -> str:
        return self.turns[0]


@dataclass
class PromptSet:
    name: str  # the benchmark, or "prompts" for a plain prompts file
    path: Path
    prompts: list[BenchmarkPrompt]
    rendering: str  # how a row became a prompt, for the report
    rows: int = 0  # rows in the file (before any selection)
    selection: str = "all rows, file order"
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, "path": str(self.path), "rows": self.rows, "count": len(self.prompts),
                "selection": self.selection, "rendering": self.rendering,
                "with_reference": sum(p.reference is not None for p in self.prompts)}


def _field(row: dict, names: tuple[str, ...], where: str, required: bool = True):
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    if required:
        raise AuditError(f"{where}: needs a {' or '.join(repr(n) for n in names)} field")
    return None


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise AuditError(f"{where}: {what} must be a non-empty string")
    return value


def _zlab(name: str):
    """z-lab's formatter of set `name`, called on a row holding the fields it reads."""
    return zlab_datasets()[name]["format"]


def gsm8k(row: dict, where: str) -> BenchmarkPrompt:
    question = _text(_field(row, ("question",), where), where, "'question'")
    return BenchmarkPrompt("", [_zlab("gsm8k")({**row, "question": question})], row.get("answer"))


def math500(row: dict, where: str) -> BenchmarkPrompt:
    problem = _text(_field(row, ("problem",), where), where, "'problem'")
    return BenchmarkPrompt(str(row.get("unique_id", "")), [_zlab("math500")({**row, "problem": problem})],
                           row.get("solution") or row.get("answer"))


def aime(row: dict, where: str) -> BenchmarkPrompt:
    # AIME exports name the problem 'problem' (AI-MO, HuggingFaceH4, math-ai) or 'Problem'/'question'.
    problem = _text(_field(row, ("problem", "Problem", "question"), where), where, "the problem")
    reference = _field(row, ("solution", "Solution", "answer", "Answer"), where, required=False)
    return BenchmarkPrompt(str(_field(row, ("id", "ID", "problem_idx"), where, required=False) or ""),
                           [_zlab("math500")({"problem": problem})], None if reference is None else str(reference))


def humaneval(row: dict, where: str) -> BenchmarkPrompt:
    prompt = _text(_field(row, ("prompt",), where), where, "'prompt'")
    return BenchmarkPrompt(str(row.get("task_id", "")), [_zlab("humaneval")({**row, "prompt": prompt})],
                           row.get("canonical_solution"))


def mbpp(row: dict, where: str) -> BenchmarkPrompt:
    # The sanitized config names the task 'prompt'; the full config names it 'text'.
    prompt = _text(_field(row, ("prompt", "text"), where), where, "the task")
    return BenchmarkPrompt(str(row.get("task_id", "")), [_zlab("mbpp")({**row, "prompt": prompt})], row.get("code"))


def mt_bench(row: dict, where: str) -> BenchmarkPrompt:
    # HuggingFaceH4/mt_bench_prompts holds the turns in 'prompt'; FastChat's question.jsonl in 'turns'.
    turns = _field(row, ("prompt", "turns"), where)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise AuditError(f"{where}: the turns must be a non-empty list of non-empty strings")
    rendered = _zlab("mt-bench")({**row, "prompt": list(turns)})
    return BenchmarkPrompt(str(_field(row, ("prompt_id", "question_id"), where, required=False) or ""),
                           list(rendered), None)


def alpaca(row: dict, where: str) -> BenchmarkPrompt:
    """tatsu-lab/alpaca: the instruction, then its input (when it has one) after a blank line."""
    instruction = _text(_field(row, ("instruction",), where), where, "'instruction'")
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise AuditError(f"{where}: 'input' must be a string")
    text = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return BenchmarkPrompt("", [text], row.get("output") or None)


LCB_STDIN = ("Read the input from standard input, solve the problem and write the answer to standard output "
             "(do not test directly on the sample inputs). Put your code in a Python code block:\n"
             "```python\n# YOUR CODE HERE\n```")
LCB_STARTER = ("Use the following starter code to write the solution and put your code in a Python code "
               "block:\n```python\n{starter}\n```")


def livecodebench(row: dict, where: str) -> BenchmarkPrompt:
    """livecodebench/code_generation_lite: the problem statement, then the starter code to complete,
    or, without one, the stdin/stdout instruction -- the structure of LiveCodeBench's code-generation prompt."""
    question = _text(_field(row, ("question_content",), where), where, "'question_content'")
    starter = row.get("starter_code") or ""
    if not isinstance(starter, str):
        raise AuditError(f"{where}: 'starter_code' must be a string")
    instruction = LCB_STARTER.format(starter=starter) if starter.strip() else LCB_STDIN
    return BenchmarkPrompt(str(row.get("question_id", "")), [f"{question}\n\n{instruction}"], None)


@dataclass(frozen=True)
class Benchmark:
    read: Callable[[dict, str], BenchmarkPrompt]
    rendering: str


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark(gsm8k, "z-lab dflash.benchmark DATASETS['gsm8k']['format'] on 'question'; reference: 'answer'"),
    "math500": Benchmark(math500, "z-lab DATASETS['math500']['format'] on 'problem'; reference: 'solution'"),
    "aime": Benchmark(aime, "z-lab DATASETS['math500']['format'] on the problem ('problem'/'Problem'/'question'); "
                            "reference: 'solution' or 'answer'"),
    "humaneval": Benchmark(humaneval, "z-lab DATASETS['humaneval']['format'] on 'prompt'; "
                                      "reference: 'canonical_solution'"),
    "mbpp": Benchmark(mbpp, "z-lab DATASETS['mbpp']['format'] on 'prompt' (sanitized) or 'text' (full); "
                            "reference: 'code'"),
    "mt-bench": Benchmark(mt_bench, "z-lab DATASETS['mt-bench']['format'], both turns ('prompt' or 'turns'); "
                                    "each turn after the model's own reply to the previous; no reference"),
    "alpaca": Benchmark(alpaca, "tatsu-lab/alpaca: 'instruction', then 'input' after a blank line when not empty; "
                                "reference: 'output'"),
    "livecodebench": Benchmark(livecodebench, "code_generation_lite: 'question_content', then the starter code to "
                                              "complete or the stdin/stdout instruction; no reference"),
}
ALIASES = {"math-500": "math500", "aime24": "aime", "aime25": "aime", "mtbench": "mt-bench", "mt_bench": "mt-bench",
           "lcb": "livecodebench"}


def benchmark_name(name: str) -> str:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in BENCHMARKS:
        raise AuditError(f"--prompts {name}: unknown benchmark; known: {', '.join(BENCHMARKS)} "
                         "(or a plain prompts file without NAME:)")
    return key


def parse_prompts_flag(value: str) -> tuple[str | None, Path]:
    """`NAME:PATH` (a benchmark file) or `PATH` (a plain prompts file). A path holding ':' is still a
    path when its text before the first ':' is no benchmark name."""
    name, sep, rest = value.partition(":")
    if sep and rest and ALIASES.get(name.lower(), name.lower()) in BENCHMARKS:
        return benchmark_name(name), Path(rest)
    if sep and rest and "/" not in name and not Path(value).exists():
        benchmark_name(name)  # a NAME: that is no benchmark: say so
    return None, Path(value)


def _unique_ids(prompts: list[BenchmarkPrompt], path: Path) -> None:
    seen: set[str] = set()
    for index, prompt in enumerate(prompts):
        if not prompt.id or prompt.id in seen:
            prompt.id = f"{prompt.id}#{index}" if prompt.id else str(index)
        seen.add(prompt.id)


def select(prompts: list, count: int | None) -> list:
    """z-lab's seeded selection (`dflash.benchmark._select_dataset`: a fixed shuffle, then the first `count`)."""
    from dflash.benchmark import _select_dataset

    return _select_dataset(prompts, count)


def read_prompt_set(name: str, path: str | Path, max_samples: int | None = None) -> PromptSet:
    """The rows of benchmark `name` at `path`, rendered; `max_samples` selects as z-lab's benchmark does."""
    path = Path(path)
    benchmark = BENCHMARKS[benchmark_name(name)]
    rows = read_rows(path)
    prompts = [benchmark.read(row, f"{path}: row {i}") for i, row in enumerate(rows, start=1)]
    _unique_ids(prompts, path)
    chosen = prompts
    selection = "all rows, file order"
    if max_samples is not None:  # at least 1, as `eval --max-samples` declares
        chosen = select(prompts, max_samples)
        selection = f"{len(chosen)} of {len(prompts)} by z-lab's seeded selection (_select_dataset, seed 42)"
    return PromptSet(benchmark_name(name), path, chosen, benchmark.rendering, rows=len(rows), selection=selection)
