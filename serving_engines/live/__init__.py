"""The live serving check: the drafter run in a real vLLM engine (its own environment, a subprocess), every
served round held to the audit's own replay of the drafter as trained, and each difference localized.

`engine_driver.py` runs in vLLM's environment and captures (the engine side); `host.py` starts it and holds what it
captured to the audit through `rounds.py` and `localize.py` (the host side), for `dflash_audit/audit/live_check.py`.
"""
