"""The worlds' sizes (the demo's target, the test suites' target, the tokenizer's vocabulary): plain data, importable
without torch, so that `python -m dflash_world.prebuild` can tell a world already built in a fraction of a second."""

# The embedded demo: about 3 minutes on 2 idle CPU cores (0.29 s a step), final loss 4.3.
# lr 3e-3 beat 2e-3 and 5e-3; at equal tokens, batch 4 beat batch 8 (steps count most here).
DEMO_TARGET = dict(
    hidden_size=256, num_layers=6, heads=4, kv_heads=2, head_dim=64, intermediate_size=768,
    seq_len=256, steps=600, batch_size=4, lr=3e-3, seed=0,
)
# The test-suite's target: about 40 s on 2 idle CPU cores (0.08 s a step), final loss 4.7.
TEST_TARGET = dict(
    hidden_size=128, num_layers=4, heads=4, kv_heads=2, head_dim=32, intermediate_size=384,
    seq_len=256, steps=400, batch_size=4, lr=3e-3, seed=0,
)
DEFAULT_VOCAB_SIZE = 2048
