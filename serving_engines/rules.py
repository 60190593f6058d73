"""Which engine rule gives each served field, and how we use it: `called` (the engine's function, imported),
`executed` (the function compiled from the installed file, `source_exec.py`) or `restated` (a line we read and
rewrote; `PINNED` holds the file's sha256 so that an engine upgrade fails tests/test_serving.py).

`needle` is text on the cited line; the line number is looked up in the installed file, never written here.
The "Will it serve as trained?" table of docs/serving.md is generated from `RULES` (`python -m serving_engines.rules`).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving_engines.source_exec import cite, installed_file


@dataclass(frozen=True)
class Rule:
    engine: str
    field: str
    how: str  # called | executed | restated
    module: str
    needle: str
    what: str  # the rule, in a few words
    family: str | None = None  # the family whose files give the rule (None: DFlash and DFlash2)


VLLM_SPEC = "vllm.transformers_utils.configs.speculators"
VLLM_DFLASH = "vllm.model_executor.models.qwen3_dflash"
VLLM_DFLASH2 = "vllm.model_executor.models.qwen3_dflash2"
VLLM_DFLASH_RUNNER = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
VLLM_DSPARK = "vllm.model_executor.models.qwen3_dspark"
VLLM_XPRESS = "vllm.model_executor.models.qwen3_xpress"
VLLM_DSPARK_RUNNER = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
VLLM_XPRESS_RUNNER = "vllm.v1.worker.gpu.spec_decode.xpress.speculator"
VLLM_SPEC_UTILS = "vllm.v1.worker.gpu.spec_decode.utils"
VLLM_SPEC_CONFIG = "vllm.config.speculative"
VLLM_CONFIG = "vllm.config.vllm"
SGL_UTILS = "sglang.srt.speculative.dflash_utils"
SGL_MODEL = "sglang.srt.models.dflash"
SGL_WORKER = "sglang.srt.speculative.dflash_worker_v2"
SGL_SPEC_INFO = "sglang.srt.speculative.spec_info"

RULES = (
    Rule("vllm", "loads", "called", f"{VLLM_SPEC}.base", "def extract_transformers_pre_trained_config",
         "speculators config.json -> the HF config vLLM builds the drafter from"),
    Rule("vllm", "target_layer_ids", "called", f"{VLLM_SPEC}.algos", '"target_layer_ids": [i - 1 for i in aux_layer_ids]',
         "speculators aux ids -> dflash_config.target_layer_ids (id - 1); aux ids kept for capture"),
    Rule("vllm", "target_layer_ids", "called", "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
         "def get_eagle3_aux_layers_from_config",
         "captured layers: eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1"),
    Rule("vllm", "target_layer_ids_declared", "executed", "vllm.model_executor.models.interfaces",
         "return (2, num_layers // 2, num_layers - 3)", "no ids in the config: the target model's default aux layers"),
    Rule("vllm", "layer_causal", "executed", VLLM_DFLASH, "def _dflash_layer_causal",
         "is_causal, else dflash_config.causal (for every layer), else causal = sliding"),
    Rule("vllm", "layer_causal", "called", f"{VLLM_SPEC}.algos", '"sliding_window_non_causal", True',
         "speculators: causal = not sliding_window_non_causal, absent -> non-causal"),
    Rule("vllm", "layer_windows", "executed", VLLM_DFLASH, "def _resolve_layer_attention",
         "per-layer sliding window from layer_types / use_swa / swa_window_size; mixed needs the V2 runner"),
    Rule("vllm", "num_speculative_tokens", "called", f"{VLLM_SPEC}.base", "def build_vllm_speculative_config",
         "speculators: proposal_methods[0].speculative_tokens; z-lab: the command's num_speculative_tokens"),
    Rule("vllm", "block_size", "restated", VLLM_DFLASH2, "block_size=1 + speculative_config.num_speculative_tokens",
         "block = 1 + num_speculative_tokens (the bonus token plus the masks); config block_size is not read"),
    Rule("vllm", "sample_from_anchor", "restated", VLLM_DFLASH_RUNNER, 'if dflash_config.get("sample_from_anchor", False):',
         "dflash_config.sample_from_anchor (speculators: its sample_from_anchor); the DFlash runner refuses true, "
         "only the DSpark runner samples from the anchor"),
    Rule("vllm", "draft_sampling", "restated", VLLM_SPEC_CONFIG, 'draft_sample_method: DraftSampleMethod = "greedy"',
         "drafts are the argmax at any temperature unless speculative_config draft_sample_method='probabilistic'"),
    Rule("vllm", "rope_theta", "called", "vllm.transformers_utils.config", "def set_default_rope_theta",
         "rope_parameters, rope_theta defaulting to 1e6 (qwen3_dflash.py)"),
    Rule("vllm", "partial_rotary_factor", "restated", "vllm.model_executor.layers.rotary_embedding",
         'partial_rotary_factor = rope_parameters.get("partial_rotary_factor", 1.0)',
         "rotary width = head_dim * rope_parameters.partial_rotary_factor"),
    Rule("vllm", "target_layer_capture", "restated", "vllm.model_executor.models.interfaces",
         "value = hidden_states + residual if residual is not None else hidden_states",
         "after each captured layer, the residual stream: the last layer's before the final norm (training reads it "
         "after); the live check observes it"),
    Rule("vllm", "is_neox_style", "restated", VLLM_DFLASH, 'is_neox_style = getattr(config, "is_neox_style", True)',
         "is_neox_style, default True"),
    Rule("vllm", "mask_token_id", "restated", VLLM_DFLASH, '"mask_token_id", getattr(self.config, "mask_token_id", None)',
         "dflash_config.mask_token_id, else config.mask_token_id"),
    Rule("vllm", "draft_vocab_size", "restated", VLLM_DFLASH, 'self.config.draft_vocab_size = getattr(self.config, "vocab_size"',
         "draft_vocab_size, default vocab_size; a smaller one needs d2t"),
    Rule("vllm", "draft_to_target", "restated", VLLM_DFLASH, 'name = name.replace("d2t", "draft_id_to_target_id")',
         "a `d2t` tensor fills draft_id_to_target_id (offsets); absent, its zeros read draft id k as target id k"),
    Rule("vllm", "conv_kernel_size", "restated", VLLM_DFLASH2, 'taps=int(draft_config["conv_kernel_size"])',
         "DFlash2 sizes from dflash_config"),
    Rule("vllm", "input_embedding_scale", "restated", VLLM_DFLASH2, 'draft_config.get("input_embedding_scale", 1.0)',
         "dflash_config.input_embedding_scale, default 1"),
    Rule("vllm", "output_multiplier", "restated", VLLM_DFLASH2, 'scale=float(draft_config.get("output_multiplier", 1.0))',
         "dflash_config.output_multiplier / final_logit_softcapping on the candidate logits"),
    Rule("vllm", "tensors_refused", "restated", VLLM_DFLASH2, "self.predecessor_codebook = nn.Parameter(",
         "the codebooks are bare parameters: a `.weight` name is a nested weight, refused"),
    # DSpark: update_dspark (called through SpeculatorsConfig) and the DFlash backbone's rules above, plus these.
    Rule("vllm", "loads", "called", f"{VLLM_SPEC}.algos", '@register_speculator("dspark")',
         "speculators dspark -> Qwen3DSparkModel: aux ids, sample_from_anchor (absent: false), the head keys "
         "copied; sliding_window_non_causal dropped", "dspark"),
    Rule("vllm", "sample_from_anchor", "restated", VLLM_DSPARK_RUNNER,
         'self.draft_model_config.hf_config, "sample_from_anchor", True',
         "true: K queries from the anchor on, each a prediction; false: the anchor as bonus token + K masks",
         "dspark"),
    Rule("vllm", "block_size", "restated", VLLM_DSPARK_RUNNER, "self.num_query_per_req = self.num_speculative_steps",
         "block = K (sample_from_anchor) or 1 + K", "dspark"),
    Rule("vllm", "mask_token_id", "executed", VLLM_SPEC_UTILS, "def get_parallel_drafting_token_id",
         "dflash_config.mask_token_id, else mask_token_id, else dspark_noise_token_id, ...", "dspark"),
    Rule("vllm", "markov_head_type", "restated", VLLM_DSPARK, "self.markov_head = DSparkMarkovHead(",
         "the vanilla Markov head (markov_w1, markov_w2) whatever markov_head_type says: a gated or rnn head's "
         "tensors have no parameter, refused", "dspark"),
    Rule("vllm", "markov_rank", "restated", VLLM_DSPARK, "config.markov_rank,", "markov_rank", "dspark"),
    Rule("vllm", "enable_confidence_head", "restated", VLLM_DSPARK, 'if getattr(config, "enable_confidence_head", '
         'False):', "enable_confidence_head, default false; used only with enable_adaptive_verification", "dspark"),
    Rule("vllm", "confidence_head_with_markov", "restated", VLLM_DSPARK,
         'with_markov = getattr(config, "confidence_head_with_markov", False)',
         "confidence_head_with_markov, default false (speculators: true); input [hidden, Markov embedding]", "dspark"),
    Rule("vllm", "runner", "restated", VLLM_CONFIG, 'unsupported.append("dspark speculative decoding")',
         "the V1 model runner refuses DSpark: the V2 runner (Triton, a GPU) serves it", "dspark"),
    # XPress: no speculators translation; what its model file and runner read from a drafter's keys and tensors.
    Rule("vllm", "loads", "called", f"{VLLM_SPEC}.base",
         "if speculators_model_type not in SUPPORTED_SPECULATORS_TYPES:",
         "no `xpress` among the translated speculators types: the directory is refused", "xpress"),
    Rule("vllm", "architecture", "executed", VLLM_SPEC_CONFIG, "XPRESS_ARCHITECTURES = frozenset(",
         "XPress is served under method dflash for these architectures only", "xpress"),
    Rule("vllm", "num_jacobi_passes", "restated", VLLM_XPRESS_RUNNER, 'int(getattr(hf, "xpress_num_passes", 6))',
         "xpress_num_passes, default 6 (speculators writes num_jacobi_passes)", "xpress"),
    Rule("vllm", "xpress_rank", "restated", VLLM_XPRESS, 'rank=getattr(config, "xpress_rank", 256),',
         "xpress_rank, default 256", "xpress"),
    Rule("vllm", "xpress_mlp_hidden", "restated", VLLM_XPRESS, 'mlp_hidden=getattr(config, "xpress_mlp_hidden", 512),',
         "xpress_mlp_hidden, default 512 (speculators writes xpress_mlp_ratio: hidden = rank x ratio)", "xpress"),
    Rule("vllm", "refiner_block_size", "restated", VLLM_XPRESS, 'block_size=getattr(config, "xpress_block_size", None)',
         "xpress_block_size, else num_speculative_steps (no vLLM file sets it: 15) + 1", "xpress"),
    Rule("vllm", "refiner_candidates", "restated", VLLM_XPRESS, 'topc=getattr(config, "xpress_topc", 512),',
         "each Jacobi pass scores the base logits' top xpress_topc (default 512) candidates only", "xpress"),
    Rule("vllm", "refiner_slot0", "restated", VLLM_XPRESS_RUNNER, "tok_am1 = anchor_ids",
         "slot 0's predecessor in the refiner is the anchor itself (speculators trains the token before it)",
         "xpress"),
    Rule("vllm", "sample_from_anchor", "restated", VLLM_XPRESS_RUNNER, 'if getattr(hf, "sample_from_anchor", False):',
         "the XPress runner refuses sample_from_anchor=true", "xpress"),
    Rule("vllm", "tensors_refused", "restated", VLLM_XPRESS, 'if name.startswith("xpress_head."):',
         "refiner tensors are read under xpress_head.* only: speculators' refiner_head.* have no parameter", "xpress"),
    Rule("vllm", "runner", "restated", VLLM_CONFIG, 'unsupported.append("xpress speculative decoding")',
         "the V1 model runner refuses XPress: the V2 runner (Triton, a GPU) serves it", "xpress"),
    Rule("sglang", "loads", "restated", "sglang.srt.utils.hf_transformers.config", "config = AutoConfig.from_pretrained(",
         "the draft config is transformers' AutoConfig (no remote code): a speculators directory has no model_type"),
    Rule("sglang", "config", "executed", SGL_UTILS, "def parse_dflash_draft_config",
         "dflash_config (or top level): ids, block, mask token, DFlash2 sizes"),
    Rule("sglang", "sample_from_anchor", "executed", SGL_UTILS, "def parse_dflash_draft_config",
         "no slot-layout setting: the DFlash worker drafts with the anchor as the bonus token"),
    Rule("sglang", "target_layer_ids", "executed", SGL_UTILS, "def resolve_target_layer_ids",
         "declared ids as z-lab ids, else build_target_layer_ids(runtime target layers, draft layers)"),
    Rule("sglang", "target_layer_ids_declared", "executed", SGL_UTILS, "def build_target_layer_ids",
         "the fallback guess"),
    Rule("sglang", "layer_causal", "executed", SGL_MODEL, "def _get_dflash_attention_type",
         "is_causal for every layer, else DECODER (causal) for sliding, ENCODER_ONLY for full"),
    Rule("sglang", "layer_windows", "executed", SGL_MODEL, "def _get_dflash_layer_attention_params",
         "window_left = sliding_window - 1 on sliding layers; no layer_types: all full, non-causal"),
    Rule("sglang", "block_size", "restated", "sglang.srt.arg_groups.speculative_hook", "inferred_block_size = 16",
         "--speculative-num-draft-tokens, else the config's block_size, else 16"),
    Rule("sglang", "rope_theta", "executed", "sglang.srt.utils.hf_transformers.common", "def get_rope_config",
         "rope_parameters.rope_theta, else rope_theta, else 10000"),
    Rule("sglang", "partial_rotary_factor", "restated", SGL_MODEL,
         'partial_rotary_factor = float(getattr(config, "partial_rotary_factor", 1.0))',
         "config.partial_rotary_factor (default 1) unless rope_dim is given"),
    Rule("sglang", "is_neox_style", "restated", SGL_MODEL, '"rope_is_neox_style", getattr(config, "is_neox_style", True)',
         "rope_is_neox_style, else is_neox_style, default True"),
    Rule("sglang", "mask_token_id", "executed", SGL_WORKER, "def _resolve_mask_token_id",
         "mask_token_id < target vocab; without one, the tokenizer's <|MASK|> (added if absent)"),
    Rule("sglang", "target_layer_capture", "restated", "sglang.srt.models.qwen3", "if i in self.layers_to_capture",
         "captured before layer id + 1, inside the layer loop: the target's last layer is never captured"),
    Rule("sglang", "hidden_act", "restated", SGL_MODEL, 'hidden_act = getattr(config, "hidden_act", "silu")',
         "silu or swigluoai, anything else refused"),
    Rule("sglang", "input_embedding_scale", "restated", SGL_WORKER, "get_dflash_noise_embedding_scale",
         "the noise-embedding scale comes from the target model, not the draft config"),
    Rule("sglang", "tensors_ignored", "restated", SGL_MODEL, "# Ignore unexpected weights",
         "a name with no parameter is dropped silently (codebooks are bare parameters)"),
)

# sha256 of every installed file a `restated` rule was read from: an engine upgrade changes it and the pin test fails.
PINNED = {
    "vllm.model_executor.models.interfaces": "f3eb476c960b27cc18edeed31e391412e39d525e269d16f6fee26ebdbd01e8cf",
    "sglang.srt.models.qwen3": "bc6b5d40731d21d9be6ba287fd9983810ca7998f2ff394a251bc6ee357ad1121",
    VLLM_DFLASH: "2f3b8ea98345f06a30d41596d0b6b738049f483fbc8961b9267d7ba771bb658d",
    VLLM_DFLASH2: "11ac6ba8c6db702375970e68cd042b98783a5c43b87f9bfa27e88463316bf499",
    VLLM_DFLASH_RUNNER: "27368c98791397625603ba45782119e4d306880841900a9d07587a6d6757d3ee",
    "vllm.model_executor.layers.rotary_embedding": "b0487bc2998033fe5e8007759329728342c8827b1f2d6e55e750abe826513c74",
    "sglang.srt.arg_groups.speculative_hook": "d10577c3b5f333ae560adc467e8ca8864196154da5a26683011328c6765a59f0",
    SGL_MODEL: "1c8307ba7f63fd41f53435fbdabdad8c9e9a04847bef4959f1f8fc16ea6db0ae",
    SGL_WORKER: "87a7f5808ea12bec0fb4abb8ffc0d2082963a79b5de9ab435063e0dfa8ce8431",
    VLLM_DSPARK: "7be21c094a49520c41f418aceea71b338d5e15b14b3ddd052e6d6f7b7ac8ae79",
    VLLM_XPRESS: "a42b9d19e5c9916d2a12e5b8419138946865f080528a6d1c72712fff602d5dcf",
    VLLM_DSPARK_RUNNER: "3c22193d18f0d2f5f5dcd4ec907f52e10710a5b39b084dfa03eef254d3c174eb",
    VLLM_XPRESS_RUNNER: "e805a2a5a254207967b35ff7f2526926503d18246b3d9ac71431091ce2d95019",
    VLLM_CONFIG: "892088ef8dc5c7fa9d50cdf083dd776fd45e8d148d53b4a3279b2e79abeab0ca",
    VLLM_SPEC_CONFIG: "e1a32e585b677f6c89b0db6848c376733e1860ea5ea328180d638621d379239e",
    "sglang.srt.utils.hf_transformers.config": "c094a72d75c298b6943b0ac30df7f4726eef5378fe0d6ed184780c2290d4493d",
}


def rule_module(module: str) -> str:
    """A package module (`...rotary_embedding`) is its `__init__.py`."""
    try:
        installed_file(module)
        return module
    except Exception:  # noqa: BLE001 -- a package: its __init__
        return f"{module}.__init__"


def source(engine: str, field_name: str, family: str | None = None) -> str:
    """engine file:line of the first rule for (engine, field): the family's own rule, else the DFlash one."""
    own = [r for r in RULES if r.engine == engine and r.field == field_name and r.family == family]
    shared = [r for r in RULES if r.engine == engine and r.field == field_name and r.family is None]
    for rule in (own or shared)[:1]:
        return cite(rule_module(rule.module), rule.needle)
    return ""


def markdown() -> str:
    lines = ["| engine | field | how we use it | engine source | rule |", "|---|---|---|---|---|"]
    lines += [f"| {r.engine} | {r.field}{f' ({r.family})' if r.family else ''} | {r.how} | "
              f"`{cite(rule_module(r.module), r.needle)}` | {r.what} |" for r in RULES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")


def check_installed() -> None:
    """Every rule's line is in the installed engines and their config code imports (`make setup` runs this)."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig  # noqa: F401
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,  # noqa: F401
    )

    for rule in RULES:
        cite(rule_module(rule.module), rule.needle)
