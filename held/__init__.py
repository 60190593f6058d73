"""Third-party DFlash codebases held to the references through `impl/interface.py`
(`pytest conformance --impl NAME`). The serving engines a drafter is held to are `serving_engines/`."""

# Short names for `pytest conformance --impl NAME`, beside reference_adapters.IMPLEMENTATIONS.
HELD = {"specforge": "held.specforge:SpecForgeImplementation", "modelopt": "held.modelopt:ModelOptImplementation"}
