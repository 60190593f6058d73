"""#16 block size: defaults of the two references (z-lab 16, speculators 8) and of the implementation."""

import pytest
from transformers import Qwen3Config

from conformance.tolerances import EXACT

pytestmark = [pytest.mark.quick, pytest.mark.pitfall(16)]


def zlab_default_block_size() -> int:
    from dflash.model import DFlashDraftModel

    config = Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=16)
    config.num_target_layers = 4
    config.dflash_config = {"target_layer_ids": [1], "mask_token_id": 0}
    return DFlashDraftModel(config).block_size


def speculators_default_block_size() -> int:
    from speculators.models.dflash import DFlashSpeculatorConfig

    return DFlashSpeculatorConfig.model_fields["block_size"].default


def test_reference_default_block_sizes_p16(conform):
    conform.compare(("speculators", "zlab"), speculators_default_block_size(),
                    zlab_default_block_size(), EXACT, what="default block size when a config names none")


def test_spec_default_block_size_p16(conform, under_test):
    if under_test.name != "ours":
        conform.not_applicable((under_test.name, "zlab"), "no DraftSpec default to compare")
        return
    from impl.spec import DraftSpec

    conform.compare(("ours", "zlab"), DraftSpec.model_fields["block_size"].default,
                    zlab_default_block_size(), EXACT, what="DraftSpec default block size vs z-lab's")
