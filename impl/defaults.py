"""The values a config gets for what it leaves out: one table per kind, imported wherever a default is read.

tests/test_restatements.py checks that every reader holds these very tables.
"""

from __future__ import annotations

# A Qwen3 decoder layer's settings, as `transformers.Qwen3Config()` fills them in (tests/test_spec.py holds each to
# it): what both references apply to a drafter config that states none (z-lab builds its DFlashDraftModel from a
# Qwen3Config, speculators its layer config), hence the one rope theta and window every reader defaults to.
QWEN3_DEFAULTS = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "hidden_act": "silu", "attention_bias": False}
# The rotary settings a config gets when it states none: transformers' `rope_type` "default" (unscaled), every
# head dim rotated, neox style (rotate_half; vLLM's and SGLang's `is_neox_style` default True).
ROTARY_DEFAULTS = {"rope_scaling": None, "partial_rotary_factor": 1.0, "rope_style": "neox"}
# z-lab `dflash_config` extras (embedding scale, logit multiplier, soft-capping) and their no-op values;
# speculators has none of them.
ZLAB_EXTRAS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
# The block size each reference's config gets when it names none.
BLOCK_SIZE_DEFAULTS = {"zlab": 16, "speculators": 8}
