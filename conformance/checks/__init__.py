"""Component checks: `check(cmp, a, b, case)` compares implementation `a` with `b` on one case.

Test files run them under hypothesis; the planted-bug self-test runs them on a fixed case
with `impl/` mutated. Each check reports under its PITFALLS component.
"""
