"""The DFlash divergence catalogue: the known ways a home-grown drafter silently diverges from
the references, one entry per rule. The single source for the audit's findings, the
conformance suite's components and the repository's docs/pitfalls.md (generated from this table by
`python -m catalogue.pitfalls`; tests/test_pitfalls.py keeps the two equal).

Facts were read from the pinned reference packages (speculators 0.9.0, dflash 0.1.0,
transformers 5.19); where a fact here is wrong, the conformance test that checks it wins.
Notation: N = target decoder layers, H = hidden size, B = block size, `hs` = the tuple a
Hugging Face model returns with `output_hidden_states=True`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pitfall:
    number: int
    component: str  # what the conformance suite reports it under
    title: str  # what the audit's findings call it
    reference: str  # what the references do
    classic_bug: str

    @property
    def checked_by(self) -> str:
        """`conformance` (a component test holds implementations to the references) or `audit`
        (a property of checkpoints, which the static audit and the loaders check)."""
        return "audit" if self.component in AUDIT_COMPONENTS else "conformance"


AUDIT_COMPONENTS = {"architecture", "weights", "format", "serving", "hidden_state_data"}


CATALOGUE = (
    Pitfall(1, 'target_layers', 'target_layers (selection)',
            'z-lab default `build_target_layer_ids(N, n)`: `n == 1` → `[N // 2]`, else `round(1 + i*(N-4)/(n-1))` for i in 0..n-1 (N=64, n=5 → `[1, 16, 31, 46, 61]`). speculators with no ids given: `[2, N//2, N-3]` and a warning.',
            'a hand-picked list that is not what the reference used'),
    Pitfall(2, 'target_layers', 'target_layers (index convention)',
            "z-lab reads `hs[id + 1]` (`hs[0]` is the embedding output), so id = 0-based decoder layer whose output is used. speculators' `aux_hidden_state_layer_ids` are already shifted: its converter maps z-lab id `i` → `i + 1` and drops `i + 1 == N`. Same model: z-lab `[1,16,31,46,61]` = speculators `[2,17,32,47,62]`.",
            'off-by-one: reading `hs[id]`'),
    Pitfall(3, 'targets', 'targets (which hidden state)',
            'In transformers 5.x, `hs[-1]` is **post final norm** (`== model.norm(raw output of the last layer)`); every other entry is a raw layer output. speculators computes targets as `verifier_lm_head(verifier_norm(verifier_last_hidden_states))` from the **raw** output of the last decoder layer.',
            'targets from an intermediate layer (e.g. layer 61 of 64) instead of the final one; or `verifier_norm(hs[-1])` = double normalisation'),
    Pitfall(4, 'fc_dims', 'fc_dims',
            '`fc = Linear(len(target_layer_ids) * H, H, bias=False)`, then `hidden_norm` (RMSNorm). Every selected layer feeds fc.',
            'fc fed 4 of 5 layers (in_features 20480 instead of 25600 at H=5120), the deepest layer kept only for targets'),
    Pitfall(5, 'target_alignment', 'targets (alignment)',
            '`sample_from_anchor=False` (DFlash): slot 0 is the anchor (input, untrained); slot k ≥ 1 at position `a + k` is trained toward the target logits computed at position `a + k - 1`. DSpark (`True`): slot k toward position `a + k`.',
            'off-by-one roll'),
    Pitfall(6, 'loss_weights', 'loss_weights',
            "`dflash_loss_decay`: `w(0) = 0`, `w(k) = exp(-(k-1)/gamma)` for k ≥ 1; DSpark: `w(k) = exp(-k/gamma)`. speculators' `dflash_decay_gamma` default 4.0 (used with fixed decay; the resolved `dflash` recipe uses D-PACE instead, #18). Reduction: `sum(w * mask * loss) / (sum(mask) + 1e-5)` per sequence, then mean — the denominator counts masked positions, not weights.",
            'gamma 7.0; weight on slot 0; dividing by the sum of weights'),
    Pitfall(7, 'loss', 'loss (kind)',
            "speculators' model-level default is KL to the target distribution (`kl_div`); its `TrainConfig` resolves `dflash` to `ce` (#18); `ce` uses argmax of target logits as hard labels; also `rkl`, `jsd`, `tv`, ...",
            'mixing up which was used when comparing runs'),
    Pitfall(8, 'anchors', 'anchors',
            'speculators `select_anchors`: uniform without replacement over loss-masked positions, excluding the last B positions, sorted, at most `max_anchors` (default 512); unused slots are marked invalid and masked out of the loss.',
            'anchors in the last block; padded anchors counted in the loss'),
    Pitfall(9, 'training_mask', 'mask (training)',
            'speculators `create_anchor_block_mask_mod`: a query of block j (anchor `a_j`) sees base tokens with position `< a_j` (strictly) in the same document (document id != -1), within `a_j - window` for sliding layers; plus its own block: all of it for full-attention layers, only earlier-or-equal slots for sliding layers unless `sliding_window_non_causal`. Never another block.',
            '`<=` instead of `<`; crossing documents; causal full-attention blocks'),
    Pitfall(10, 'inference_mask', 'mask (inference)',
            'z-lab 0.1.0: context = target hidden states of accepted tokens; block = `[bonus token, mask × (B-1)]`; full layers see all context and the whole block; sliding layers are causal within the block (`is_causal` defaults to true for `sliding_attention`) and windowed.',
            'inference mask ≠ training mask'),
    Pitfall(11, 'layer_types', 'layer_types',
            "z-lab's newer drafters mix `sliding_attention` and `full_attention` layers (e.g. 4 sliding, window 2048, + 1 full); older ones are all full.",
            'treating sliding layers as full (harmless only while context < window)'),
    Pitfall(12, 'positions', 'positions',
            'block tokens take positions `a .. a+B-1`, continuing the context; rotary is applied to the query at the last `q_len` positions of cos/sin.',
            'restarting positions at 0 per block'),
    Pitfall(13, 'embeddings', 'embeddings / head',
            "the drafter borrows the target's input embeddings and LM head; z-lab scales the noise embedding by `dflash_config.input_embedding_scale` (default 1) and applies `output_multiplier` / `final_logit_softcapping` when present. speculators stores `embed_tokens`, `lm_head`, `verifier_lm_head`, `verifier_norm` copied from the verifier — verifier-owned, not draft-body weights.",
            'comparing verifier-owned tensors as if they were trained'),
    Pitfall(14, 'mask_token', 'mask_token',
            '`dflash_config.mask_token_id` (z-lab) / `mask_token_id` (speculators); must be < vocab size and equal in training and inference.',
            'a different id in training and eval'),
    Pitfall(15, 'noise', 'recipe (noise)',
            "any hidden-state noise/augmentation applies to the drafter's inputs only; targets are computed from clean verifier states.",
            'noise leaking into target logits'),
    Pitfall(16, 'block_size', 'block_size',
            'z-lab default 16, speculators default 8; a DFlash round accepts at most B-1 drafted tokens plus 1 bonus token.',
            'evaluating with a different B than trained'),
    Pitfall(17, 'tau', 'tau',
            "acceptance length per round = accepted draft tokens + 1 (bonus). Per-prompt τ = mean over rounds; z-lab reports the mean of per-prompt means and a histogram over 0..B. speculators' training metric EAL = Σ_k Π_{i≤k} acc_i over drafted slots. DDTree: best-first heap over the per-depth top-k log-probabilities of one drafter pass under a node budget; the target verifies the tree with an ancestor-only mask; the walk follows the target's token while it matches a child.",
            'comparing τ computed by different definitions'),
    Pitfall(18, 'loss_weights', 'loss_weights (D-PACE)',
            'speculators 0.9.0\'s `TrainConfig` resolves `--speculator-type dflash` to CE loss + `per_position_loss_weight="dpace"` (`losses/utils.py: dpace_loss_decay`): confidence `q = exp(-CE)` per slot, smoothed `(1-α)q + α` (α = `dpace_alpha`, 0.5), prefix product within the block, then a suffix sum, masked, computed without gradient; block 16, 5 layers. The model-level defaults (KL, fixed decay gamma 4) are what `DFlashDraftModel.forward` takes when called directly.',
            'holding a D-PACE run to gamma; weights that carry gradient; the sum run the wrong way; weight on the anchor slot'),
    Pitfall(19, 'architecture', 'architecture (DFlash2)',
            "speculators `dflash2` and z-lab `DFlash2DraftModel`: a grouped dynamic causal convolution around attention and around the MLP in every layer (`conv_kernel_size`, `conv_group_size`), and a candidate selector that reranks the top-k drafter logits with predecessor/successor codebooks (`selector_rank`, `selector_top_k`); z-lab's published files store the codebooks without `.weight`. `dflash2` defaults to bidirectional sliding windows inside the block, block 8, fixed decay, KL.",
            'auditing a DFlash2 drafter as a DFlash one and dropping its extra tensors'),
    Pitfall(20, 'weights', 'weights (unexplained tensors)',
            "every tensor of either checkpoint must be accounted for: draft body, verifier-owned, or a known family's extra; anything else is reported.",
            'a loader that keeps only the tensors it expects, so an extra or renamed tensor vanishes from the audit'),
    Pitfall(21, 'format', 'format (foreign checkpoints)',
            "teams' own trainers save their own names (`context_proj`, `blocks.N.attn`), wrappers (`module.`, `model_state_dict`), optimizer state and pickled args (`argparse.Namespace`). Which target layers feed fc cannot be read from the weights; only from declared args.",
            'guessing the layer ids from a default; unpickling args with full `torch.load`'),
    Pitfall(22, 'conv', 'conv (DFlash2 grouped dynamic causal convolution)',
            "DFlash2 wraps each layer's attention and MLP in `GroupedDynamicCausalConv`: one projection of the sublayer input gives `[2, K, G]` deltas (input side, output side; G = H / `conv_group_size`); tap t of slot i reads slot i - t, coefficient `base_kernel[side, t, channel] + delta[slot, t, group]`, channels grouped contiguously; taps never cross a block (speculators restarts every B slots, z-lab sees one block per forward). Initialized as the identity.",
            'the causal shift off by one (tap t reads slot i - t - 1); interleaved instead of contiguous groups; taps that leak across blocks in training'),
    Pitfall(23, 'selector', 'selector (DFlash2 candidate scores and path)',
            "z-lab `CandidateSelector.select`: the unary top-k per slot (`topk(sorted=False)`), each scored `unary + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>`; the chosen token is the next slot's predecessor, the block's first token the first slot's. Sampling draws from softmax(scores / T) over the k candidates and rejection-samples against that distribution. speculators' `score_candidates` is the same score.",
            'the top-k reranked without the unary term; the predecessor taken from the wrong slot; sampling from the unary distribution while proposing the selector\'s token'),
    Pitfall(24, 'selector_loss', 'selector_loss (DFlash2 training candidates and loss)',
            "speculators `selector_training_candidates`: the unary top-k (best first); when the hard target (the verifier's argmax) is absent it replaces the last candidate, so every slot has a label. Predecessors are teacher-forced: slot k's is the true token at anchor + k - 1 (slot 0: the anchor). Loss = K-way CE of the scores, weighted per slot like the unary loss (fixed decay or D-PACE on its own CE) and reduced by Σ mask; total = unary + `selector_loss_alpha` × selector.",
            'predecessors from the drafted tokens or the same slot; a target appended past k; the selector loss left unweighted'),
    Pitfall(25, 'window_direction', 'window_direction (bidirectional sliding windows)',
            "speculators `sliding_window_non_causal` (default True for dflash2, False for dflash; z-lab `is_causal: false`): sliding-window layers see their whole block instead of a causal one. The window still bounds the context: training `base ≥ anchor - W`, inference `q - k < W` and `k - q < W`. Full-attention layers are bidirectional either way.",
            'a DFlash2 drafter served with causal sliding blocks; a non-causal flag that also drops the window'),
    Pitfall(26, 'serving', 'serving: target layer ids',
            "vLLM 0.33 captures `eagle_aux_hidden_state_layer_ids` (speculators: its aux ids; z-lab: `dflash_config.target_layer_ids + 1`), i.e. z-lab id i = aux id i + 1 (#2); with none declared it takes the target model's default aux layers `(2, N//2, N-3)`. SGLang 0.5.23 reads `dflash_config.target_layer_ids` as z-lab ids and, with none, guesses `build_target_layer_ids(runtime N, draft layers)` (#1). `dflash-audit serve-check` resolves both through the engines' code.",
            'ids written in the other convention (off by one in the engine); no ids in the config, so the engine guesses (a count collision loads cleanly and collapses acceptance)'),
    Pitfall(27, 'serving', 'serving: per-layer attention and causality',
            "vLLM `_dflash_layer_causal`: `is_causal`, else `dflash_config.causal` — applied to every layer — else causal = sliding; speculators' `sliding_window_non_causal: false` becomes `causal: true`, so a full-attention layer runs causal (#25). SGLang: `is_causal` for every layer, else causal sliding / bidirectional full; no `layer_types` means all full. Mixed sliding + full layers need vLLM's V2 runner.",
            'a speculators DFlash drafter with full-attention layers served causal by vLLM; a causality flag meant for sliding layers applied to full ones'),
    Pitfall(28, 'serving', 'serving: mask token',
            "both engines feed `dflash_config.mask_token_id` (#14); SGLang refuses an id at or past the target vocabulary and, with none, resolves the tokenizer's `<|MASK|>` (adding it). The id must be inside the target's vocabulary and embedding and distinct from its eos/pad tokens.",
            'a mask token that falls back to eos/pad, or lies outside the target embedding'),
    Pitfall(29, 'serving', 'serving: speculative tokens and block size',
            "vLLM: block = 1 + `num_speculative_tokens` (the bonus token + the masks), from `--speculative-config` or a speculators config's `speculative_tokens`; it never reads `block_size`. SGLang: `--speculative-num-draft-tokens` = the block size, else the config's, else 16 (#16).",
            "passing SGLang's count (the block) to vLLM, or vLLM's (block - 1) to SGLang; a speculators config whose speculative_tokens is not block - 1"),
    Pitfall(30, 'serving', 'serving: rotary defaults',
            "vLLM defaults a missing `rope_theta` to 1e6 and reads `rope_parameters.partial_rotary_factor`; SGLang's `get_rope_config` defaults to 10000 and reads a top-level `partial_rotary_factor`; both read `is_neox_style` (default True). transformers fills `rope_parameters` (theta 10000) when a config has none.",
            'a config without rope settings served at 10000 against training at 1e6; a partial rotary factor leaked from a hybrid target that one engine applies and the other ignores'),
    Pitfall(31, 'serving', 'serving: tensors and architecture fields',
            "vLLM's DFlash2 codebooks are bare parameters: a `*_codebook.weight` name (z-lab's save_pretrained) is refused by its loader; SGLang drops any name with no parameter silently. SGLang reads the noise-embedding scale from the target, not `input_embedding_scale`; it supports `silu`/`swigluoai` only and reads the z-lab format only.",
            'a drafter that loads with its selector codebooks silently uninitialized; a speculators directory handed to SGLang'),
    Pitfall(32, 'draft_vocab', 'draft_vocab (reduced draft vocabulary and its d2t/t2d mapping)',
            "speculators `draft_vocab_size` (`DFlashSpeculatorConfig` default 32000; a `TrainConfig` without it keeps the verifier's vocabulary): `build_vocab_mappings_from_distribution` keeps the N most frequent loss-masked tokens (ties: smaller id first; fewer than N: the smallest unused ids), sorted; `d2t[k]` is an offset (target id = k + d2t[k]), `t2d` a boolean mask over the target vocabulary; both are buffers saved beside the weights, `lm_head` is the verifier head's `t2d` rows (frozen) and the targets `verifier_lm_head = head[t2d]`, so logits and targets live in the draft vocabulary. vLLM 0.33 reads `draft_vocab_size` and a `d2t` tensor (offsets, EAGLE-3 convention) from a DFlash drafter's directory and scatters the draft logits to `arange(N) + d2t` (-inf elsewhere); without `d2t` it keeps zeros, i.e. draft id k = target id k. speculators' DFlash2 and z-lab's `dflash` have no draft vocabulary.",
            'd2t applied as absolute ids instead of offsets; a reduced head shipped without its d2t (every id read as itself); targets over the full vocabulary against draft-vocabulary logits'),
    Pitfall(33, 'slot_layout', 'slot_layout (sample_from_anchor)',
            "speculators `sample_from_anchor` (`DFlashSpeculatorConfig` default False; `_build_base_config_kwargs`: default True only for `dspark`, `speculative_tokens = block_size if sample_from_anchor else block_size - 1`). The block is `[anchor, mask × (B-1)]` at `a .. a+B-1` either way. False: slot 0 proposes nothing and is untrained (loss mask 0, `dflash_loss_decay` w(0) = 0), slot k ≥ 1 proposes the token at `a + k` (targets: verifier logits at `a + k - 1`), B - 1 speculative tokens. True: every slot proposes the next token, slot k the one at `a + k + 1` (targets at `a + k`, `w(k) = exp(-k/gamma)`), B speculative tokens; a round then accepts up to B + 1. vLLM 0.33 serves True only through its DSpark runner (`sample_pos = query_pos + 1` at every query); its DFlash runner reads `dflash_config.sample_from_anchor` and refuses True. z-lab's dflash 0.1.0 has only the False layout.",
            'decoding that reads the anchor slot\'s logits under the False layout, or proposes B tokens from it; a drafter trained with one layout decoded or served with the other; a speculators config whose `speculative_tokens` ignores the layout'),
    Pitfall(34, 'mask_token_validity', 'mask_token_validity (the mask id against the target)',
            "The mask id fills the block's empty slots, so it must be a row of the target's embedding (< the target's "
            "config `vocab_size` and embedding rows) and none of its eos/pad/bos ids; a padding row past the tokenizer "
            "is fine (the target never emits it) and is the usual choice. speculators 0.9.0 `resolve_mask_token_id` "
            "(train/utils.py:16): the explicit id, else the tokenizer's mask token, else `<|MASK|>` added when "
            "`len(tokenizer) < vocab_size`, else **pad, eos or unk** with a warning. Engines: #28 (vLLM 0.33.0 reads "
            "`dflash_config.mask_token_id` and may swap in a `mask_embedding.pt` row, qwen3_dflash.py:454, 499; "
            "SGLang 0.5.23 refuses an id >= the target vocab, dflash_worker_v2.py:1391). A target may itself generate "
            "the mask id when it is a tokenizer token: z-lab 0.1.0's `dflash_generate` prefills its output buffer with "
            "the mask id and overwrites it with every produced token (model.py:197-314), so it keeps that token; "
            "speculators has no decoding loop.",
            "a mask id that falls back to eos/pad (a loop that stops on eos or strips the mask id loses real tokens); "
            "an id past the embedding; a decode loop that filters the mask id out of its output"),
    Pitfall(35, 'rotary', 'rotary settings',
            "z-lab 0.1.0 (model.py) and speculators 0.9.0 (dflash/core.py, through `flatten_rope_parameters`: a per-layer-type rope runs its `sliding_attention` entry) build transformers' `Qwen3RotaryEmbedding` from the drafter's config and rotate neox style (`rotate_half` over the whole head; interleaved/GPT-J style in neither). transformers 5.19 reads `rope_parameters` (`rope_theta`, `rope_type` and its scaling keys; the older `rope_scaling` and a top-level `rope_theta` / `partial_rotary_factor` are moved into it; theta 10000 when a config has none); its scaled types (`ROPE_INIT_FUNCTIONS`: linear, dynamic, yarn, longrope, llama3, proportional) honour `partial_rotary_factor`, Qwen3's default rope ignores it. So a default-rope drafter declaring 0.25 runs with every dim rotated, and a scaled one cannot run in either reference. speculators' trainer copies the verifier's `rope_parameters` (theta, scaling) into the draft config and drops `partial_rotary_factor` unless the rope has an `mrope_section` (train/cli.py). Partial rotary where it is applied (transformers' Qwen3-Next, vLLM): the first `head_dim * factor` dims rotated, the rest passed through; interleaved style (vLLM `is_neox_style: false`) as transformers' GPT-J: pairs (2i, 2i+1), one frequency each. How the engines read these: #30.",
            "a draft config that inherits `partial_rotary_factor`, `rope_theta` or scaling from a hybrid target it was not trained with, served by an engine that applies it; the rotated dims taken from the end of the head; a rope scaling dropped"),
    Pitfall(36, 'vocab_sizes', 'vocab_sizes (draft head, target vocabulary, tokenizer, embedding)',
            "Four sizes: the draft head's rows (`draft_vocab_size`, else `vocab_size`), the target's config "
            "`vocab_size`, its tokenizer length and its embedding rows. Targets pad their vocabulary past the tokenizer "
            "(rows the tokenizer never produces, often to a multiple of 64 or 128); the logits span the padded rows, so a draft head must too. "
            "vLLM 0.33.0 (qwen3_dflash.py:745-775): `draft_vocab_size` defaults to `vocab_size`; a head whose size "
            "differs from the target's `get_vocab_size()` gets a `draft_id_to_target_id` buffer of zeros unless the "
            "checkpoint ships `d2t`, i.e. ids are taken as identical. SGLang 0.5.23 projects draft hiddens through the "
            "target's own head cut to its `org_vocab_size` (models/dflash.py:91). speculators 0.9.0: "
            "`DFlashSpeculatorConfig.draft_vocab_size` defaults to 32000 (models/dflash/config.py:39), and any "
            "`draft_vocab_size` other than the verifier's `vocab_size` makes the head a reduced one with zero "
            "`t2d`/`d2t` buffers until a mapping is loaded (model.py:44-53).",
            "a head sized to the tokenizer's length instead of the padded vocabulary; a reduced head with no mapping "
            "(that one is #32's); a padded target reported as a divergence"),
    Pitfall(37, 'dspark_heads', 'dspark_heads (DSpark Markov and confidence heads)',
            "speculators 0.9.0 `models/dspark`: DFlash plus a Markov logit bias `markov_w2(markov_w1[prev])` of rank "
            "`markov_rank` (default 256; 0 = none), `markov_head_type` vanilla / gated (`sigmoid(gate_proj([h; e])) * "
            "e`) / rnn (a gated state over the block, `joint_proj`), added to the slot's logits; slot k's `prev` is "
            "the true token at the position before the one it proposes (sample-from-anchor, DSpark's default: the "
            "block's own token k). A confidence head `proj([h; e])` (`enable_confidence_head`, "
            "`confidence_head_with_markov`, both default true) trained by BCE toward 1 - TV(draft, target) on fixed "
            "decay, weighted `confidence_head_alpha` (1.0). Defaults: `sample_from_anchor` true, 3072 anchors. "
            "vLLM 0.33.0 (`DSparkSpeculator._sample_sequential`) drafts left to right: prev starts at the anchor, each "
            "pick is the next slot's prev; its `Qwen3DSparkModel` builds the vanilla head only.",
            "the Markov bias fed the slot's own proposal instead of the previous token; the bias added in parallel "
            "from the backbone's argmax instead of the sequential picks; the confidence target from the wrong slot"),
    Pitfall(38, 'xpress_refiner', 'xpress_refiner (XPress causal refiner and Jacobi passes)',
            "speculators 0.9.0 `models/xpress`: DFlash plus a refiner `readout(x + mlp(x))`, `x = in_proj([down_h(h); "
            "down_g(mean h); token_embed(prev)])` mixed causally by `tril(mix_l)`, rank `xpress_rank` (256), MLP "
            "`xpress_mlp_ratio` (2); anchor-as-bonus layout (slot 0's prev is the token before the anchor). "
            "Training: a teacher-forced pass, `consistency_passes` (3) free-running rounds seeded by the backbone's "
            "argmax (weight 0.3) and a base-logits anchor term (0.6); loss `{\"ce\": 0.1, \"tv\": 0.9}` by default. "
            "Inference: `num_jacobi_passes` (6) parallel passes from the backbone's argmax. vLLM 0.33.0 reads "
            "`xpress_head.*` names and `xpress_num_passes`, not speculators' `refiner_head.*` and `num_jacobi_passes`.",
            "the consistency rounds fed the true tokens; the mixer not masked to its lower triangle; one pass too "
            "few or too many at inference"),
    Pitfall(39, 'hidden_state_data', 'hidden_state_data (offline hidden-state datasets)',
            "A drafter trained offline reads each layer from a file: vLLM's `extract_hidden_states` (safetensors "
            "`hidden_states` [T, L, H] and `token_ids` [T]; its ids count the embeddings as 0, the output after "
            "decoder layer i - 1 as i, the last layer before the final norm as N: `_maybe_add_hidden_state`, "
            "vllm 0.32.0 model_executor/models/interfaces.py:1601), speculators' `hs_<i>.safetensors` (the same; its "
            "loader feeds fc every layer but the last and takes the last as `verifier_last_hidden_states`, "
            "train/data.py:324-333) and SpecForge's pickled records (`input_ids`, `loss_mask`, `hidden_states` "
            "[T, L*H], z-lab ids through SGLang's capture). Each stored layer must be the target's state that "
            "the ids claim, for every token id, and `loss_mask` must supervise assistant tokens only.",
            "all-zero states (hybrid targets: vLLM #46301, speculators #279); the last layer stripped (speculators "
            "#705); a capture one layer off (Atlas #394); `hidden_states` shorter than `token_ids` under prefix "
            "caching (vLLM #44485); the final norm applied before storing"),
    Pitfall(40, 'training_run', 'training_run (optimizer, lr schedule, clipping across steps)',
            "speculators 0.9.0's trainer resolves DFlash training to Muon on the 2-D weight matrices (lr 1e-3, "
            "momentum 0.95, weight decay 0.1, `match_rms_adamw`; `OptimizerArgs`, train/config/schema.py:339-364) "
            "plus AdamW on the rest (lr 1e-3, weight decay 0.01, torch's betas (0.9, 0.999)), split by "
            "`split_named_params_for_muon` (train/optimizers.py:59); a linear schedule warming up over total // 100 "
            "steps (train/trainer.py:206) then decaying to 0 (transformers' `get_linear_schedule_with_warmup`); "
            "`clip_grad_norm_(model.parameters(), 1.0)` (train/trainer.py:551); one backward per optimizer step; "
            "float32 master weights, bfloat16 autocast (`hidden_states_dtype`). A resume restores both the "
            "optimizer's and the schedulers' state.",
            "AdamW on every parameter (speculators PR #746 moved the default to Muon); a learning rate 10x; no warmup "
            "over a long run, or cosine decay; no clipping; gradients zeroed between backward and step (the loss "
            "does not move); a resume that restores the scheduler but not the optimizer"),
)
PITFALLS = {p.number: p for p in CATALOGUE}


# -- which entry a field's difference is reported under (the static audit reads these) ----------------------
# Architecture fields and the entry each maps to (None: no catalogue entry).
ARCHITECTURE_ENTRIES = {
    "hidden_size": None, "intermediate_size": None, "num_attention_heads": None, "num_key_value_heads": None,
    "head_dim": None, "num_hidden_layers": None, "target_vocab_size": 13, "num_target_layers": 1,
    "rms_norm_eps": None, "max_position_embeddings": 12, "attention_bias": None, "hidden_act": None,
    "input_embedding_scale": 13, "output_multiplier": 13, "final_logit_softcapping": 13,
}
# The rotary settings (#35): what a difference between two drafters (or a drafter and its trainer) does.
ROTARY_CONSEQUENCES = {
    "rope_theta": "every position is rotated at different frequencies, so the drafter reads the context's "
                  "order differently",
    "rope_scaling": "the rotary frequencies (and, for yarn and longrope, the attention scale) differ",
    "partial_rotary_factor": "a different share of each head carries the position",
    "rope_style": "the head dims are paired differently (halves vs interleaved pairs)",
}
# Fields whose difference changes no output for contexts that fit both.
ARCHITECTURE_WARNINGS = {"max_position_embeddings"}

# recipe field -> (PITFALLS entry, severity, what a difference does)
RECIPE_ENTRIES = {
    "gamma": (6, "divergence", "the loss decay weights later block positions differently, so the drafter "
              "learns a different trade-off between early and late tokens"),
    "loss_fn": (7, "divergence", "the drafter is fitted to a different objective"),
    "per_position_loss_weight": (6, "divergence", "block positions are weighted by a different rule (fixed "
                                 "exponential decay vs D-PACE's confidence-driven expected accepted length)"),
    "dpace_alpha": (6, "divergence", "D-PACE smooths the drafter's confidences differently, so later block "
                    "positions get a different share of the loss"),
    "verifier_source_layer": (3, "divergence", "the drafter is trained to predict the output of a different "
                              "target layer than the one the target decodes with"),
    "sample_from_anchor": (33, "divergence", "block slots are aligned to different target positions"),
    "noise_std": (15, "warning", "the context features were augmented differently during training"),
    "max_anchors": (8, "warning", "a different number of blocks per sequence was trained on"),
    "selector_loss_alpha": (24, "divergence", "the candidate selector's loss is weighted differently against the "
                            "unary loss, so the drafter trades its own proposals against the selector's reranking "
                            "differently"),
    "confidence_head_alpha": (37, "divergence", "the confidence head's BCE is weighted differently against the token "
                              "loss, so the backbone and heads trade the two objectives differently"),
    "consistency_weight": (38, "divergence", "the free-running Jacobi rounds are weighted differently, so the refiner "
                           "is fitted differently to the inputs it meets at inference"),
    "consistency_passes": (38, "divergence", "a different number of free-running Jacobi rounds was trained on"),
    "base_anchor_weight": (38, "divergence", "the backbone's own logits (the Jacobi seed) are held to the target with "
                           "a different weight"),
    "base_anchor_full_weight": (38, "divergence", "the backbone's own loss is weighted per position differently "
                                "(decayed vs mask only)"),
    "ce_from_data": (38, "divergence", "the ce term trains toward different labels (the data's tokens vs the "
                     "verifier's argmax)"),
}
# The slot layout's entry (`sample_from_anchor`: a drafter field, and what its recipe says training applied).
SLOT_LAYOUT_ENTRY = 33
# DFlash2's own fields: the component each belongs to, its catalogue entry, and what a difference does.
DFLASH2_SPEC_ENTRIES = {
    "conv_kernel_size": ("conv", 22, "each convolution mixes a different number of earlier block slots"),
    "conv_group_size": ("conv", 22, "the dynamic kernels are shared by different channel groups"),
    "selector_rank": ("selector", 23, "the selector's bilinear term has a different rank"),
    "selector_top_k": ("selector", 23, "the selector reranks a different number of unary candidates, so it can "
                       "propose tokens the other never considers (or not)"),
}
# DSpark's and XPress's own fields, as DFLASH2_SPEC_ENTRIES.
DSPARK_SPEC_ENTRIES = {
    "markov_rank": ("dspark_heads", 37, "the Markov logit bias has a different rank (0: none), so each slot's "
                    "proposal depends differently on the token before it"),
    "markov_head_type": ("dspark_heads", 37, "the Markov bias is computed by a different rule (vanilla, gated by "
                         "the hidden state, or a recurrent state over the block)"),
    "enable_confidence_head": ("dspark_heads", 37, "one drafter predicts each slot's acceptance and the other does "
                               "not (no token changes; the engine's adaptive verification does)"),
    "confidence_head_with_markov": ("dspark_heads", 37, "the confidence head reads a different input (with or "
                                    "without the Markov embedding)"),
}
XPRESS_SPEC_ENTRIES = {
    "xpress_rank": ("xpress_refiner", 38, "the refiner works in a different rank"),
    "xpress_mlp_ratio": ("xpress_refiner", 38, "the refiner's MLP has a different width"),
    "num_jacobi_passes": ("xpress_refiner", 38, "the block is resolved with a different number of Jacobi passes, so "
                          "the proposals (and τ) differ from the same weights"),
}
FAMILY_SPEC_ENTRIES = {"dflash2": DFLASH2_SPEC_ENTRIES, "dspark": DSPARK_SPEC_ENTRIES, "xpress": XPRESS_SPEC_ENTRIES}
# The entry a family difference cites (DFlash vs DFlash2 is #19's).
FAMILY_ENTRY = {"dflash2": 19, "dspark": 37, "xpress": 38}


def markdown() -> str:
    """docs/pitfalls.md, as committed in the repository."""
    lines = ["# DFlash divergence catalogue", "",
             "Generated from `catalogue/pitfalls.py` (`python -m catalogue.pitfalls > docs/pitfalls.md`); edit the table there.",
             "Every entry is a check the conformance suite runs or a finding the audit reports.", "",
             "Notation: N = target decoder layers, H = hidden size, B = block size, `hs` = the tuple a Hugging",
             "Face model returns with `output_hidden_states=True`.", "",
             "| # | component | what the references do | the classic bug |", "|---|---|---|---|"]
    lines += [f"| {p.number} | {p.title} | {p.reference} | {p.classic_bug} |" for p in CATALOGUE]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
