"""The audit of one recorded training step: each recorded tensor named by value against the target's candidates,
then held to the reference, one finding per root cause (audit.py composes the stages). Named step_audit, not step:
`trace.step(loss)` is the line a training script calls, and a subpackage `trace.step` would shadow it once imported."""
