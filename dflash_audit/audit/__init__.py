"""The audit engine: static (specs, recipes, tensors) and dynamic (offline τ) comparisons, and their reports."""
