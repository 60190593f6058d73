"""The DFlash divergence catalogue (`pitfalls`, the source of PITFALLS.md and of every finding's entry number)
and where each rule lives in each implementation (`rule_locations`, the README's rule table)."""
