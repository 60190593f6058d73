"""Benchmark prompt sets read from their own local files (`--prompts NAME:PATH`).

`files.py` reads a file's rows (JSON lines, a JSON list, or parquet through pyarrow, its decoded size bounded
against decompression bombs); `sets.py` turns a benchmark's rows into prompts the way the references' benchmark code
renders them (fields, few-shot, instruction): z-lab's own formatters where z-lab has the set.
"""

from foundation.benchmarks.sets import BENCHMARKS, BenchmarkPrompt, PromptSet, parse_prompts_flag, read_prompt_set

__all__ = ["BENCHMARKS", "BenchmarkPrompt", "PromptSet", "parse_prompts_flag", "read_prompt_set"]
