"""The live serving check: the drafter run in a real vLLM engine (its own environment, a subprocess), every
served round held to the audit's own replay of the drafter as trained, and each difference localized.

`engine_driver.py` runs in vLLM's environment and captures (the engine side); `host.py` starts it (the host side);
what it captured is a source of rounds (`dflash_audit/rounds/vllm.py`) held to the audit by the rounds core, for
`dflash_audit/audit/live_check.py`. `llamacpp_*.py`: llama.cpp's build, conversion and server, likewise.
"""
