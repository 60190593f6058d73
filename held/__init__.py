"""Third-party DFlash codebases held to the references through `impl/interface.py`
(`pytest conformance --impl NAME`)."""

# Short names for `pytest conformance --impl NAME`, beside reference_adapters.IMPLEMENTATIONS.
HELD = {"specforge": "held.specforge:SpecForgeImplementation"}
