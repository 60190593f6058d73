"""The run across steps (`trace --steps N`): what the run did, recorded beside the step (recorder.py), held to
speculators' resolved run (audit.py), and step parity with speculators' own training step (`--parity K`,
parity.py)."""
