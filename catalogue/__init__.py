"""The DFlash divergence catalogue (`pitfalls`, the source of docs/pitfalls.md and of every finding's entry number)
and where each rule lives in each implementation (`rule_locations`, the rule table of docs/layout.md)."""
