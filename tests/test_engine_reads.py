"""The engine-reads table (serving_engines/config_reads.py): every config key and weight-loading path the engines'
DFlash code and the references read, found in the installed source's syntax tree. The committed records
(serving_engines/engine_reads.json) and page (docs/engine-reads.md) are regenerated here from the installed code, so
that a new engine release fails until its changed table is committed."""

from __future__ import annotations

import json
import os

import pytest

from serving_engines import config_reads
from serving_engines.config_reads import (
    TABLE_DOC,
    TABLE_JSON,
    all_columns,
    column,
    column_record,
    markdown,
    scan_file,
)
from serving_engines.key_verdict import honouring
from serving_engines.live.llamacpp_env import source_tree
from serving_engines.source_exec import installed_file, line_of

VLLM_DFLASH = "vllm.model_executor.models.qwen3_dflash"


def test_the_committed_records_are_the_installed_code():
    committed = json.loads(TABLE_JSON.read_text())
    installed = [c for c in all_columns() if c.root is not None]
    assert {"vllm", "sglang", "zlab", "speculators"} <= {c.name for c in installed}  # the main venv's, always
    changed = [c.title for c in installed if column_record(c) != committed[c.name]]
    assert not changed, f"{changed} changed: run `python -m serving_engines.config_reads --write` and read the diff"


def test_the_page_is_rendered_from_the_records():
    assert TABLE_DOC.read_text() == markdown(), "run `python -m serving_engines.config_reads --write`"


def reads_of(name: str, key: str, scope: str = "top"):
    return [r for r in column(name).reads if r.key == key and r.scope == scope]


def test_reads_are_read_off_the_syntax_tree_where_the_code_reads_them():
    (scale,) = reads_of("vllm", "logit_scale")
    assert (scale.how, scale.default, scale.line) == \
        ("getattr", "1.0", line_of(VLLM_DFLASH, 'logit_scale = getattr(self.config, "logit_scale", 1.0)'))
    # `drafter_config.update(getattr(self.config, "dflash_config", {}))`: its .get reads dflash_config first.
    assert [r.how for r in reads_of("vllm", "mask_token_id", "dflash_config")] == ["get"]
    # z-lab's `_draft_value(config, name, default)` forwards the key: dflash_config, then the top level.
    assert {(r.scope, r.how, r.default) for r in reads_of("zlab", "output_multiplier")
            + reads_of("zlab", "output_multiplier", "dflash_config")} == \
        {("top", "_draft_value", "1.0"), ("dflash_config", "_draft_value", "1.0")}
    # The references' transformers classes built from the config are read too (Qwen3MLP's activation).
    assert [r.path for r in reads_of("zlab", "hidden_act")] == ["transformers/models/qwen3/modeling_qwen3.py"]
    assert reads_of("zlab", "logit_scale") == [] and reads_of("vllm", "output_multiplier", "dflash_config")[0].family \
        == "dflash2"  # vLLM reads the multiplier in its DFlash2 model only


def test_a_key_parsed_for_every_family_counts_where_it_is_applied():
    """SGLang parses output_multiplier for every family (parse_dflash_draft_config) and applies it in DFlash2's
    class only: read for DFlash2, not for DFlash."""
    assert all(r.parsed for r in reads_of("sglang", "output_multiplier", "dflash_config"))
    assert {r.where.split(".")[0] for r in reads_of("sglang", "output_multiplier", "parsed")} == {"DFlash2DraftModel"}
    assert honouring("sglang", "output_multiplier", "dflash_config", "dflash") == []
    assert honouring("sglang", "output_multiplier", "dflash_config", "dflash2") != []


def test_a_new_read_in_an_engine_release_changes_the_table(tmp_path):
    """A release that reads one more key (planted into a copy of the installed file) is a changed record: the read
    at its line, and every read below it one line on."""
    source = installed_file(VLLM_DFLASH)
    line = line_of(VLLM_DFLASH, 'logit_scale = getattr(self.config, "logit_scale", 1.0)')
    lines = source.read_text().splitlines(keepends=True)
    planted = tmp_path / "qwen3_dflash.py"
    planted.write_text("".join(lines[:line] + ['        planted = getattr(self.config, "planted_scale", 3.0)\n']
                               + lines[line:]))
    relative = "vllm/model_executor/models/qwen3_dflash.py"
    before, _ = scan_file(source, relative)
    after, _ = scan_file(planted, relative)
    (read,) = [r for r in after if r.key == "planted_scale"]
    assert (read.line, read.default, read.scope) == (line + 1, "3.0", "top")
    assert len(after) == len(before) + 1 and after != before


def test_the_weight_loading_paths_and_side_files_are_read():
    vllm = {(w.pattern, w.how) for w in column("vllm").weights}
    assert {("lm_head", "not in"), ("embed_tokens", "in"), ("t2d", "in"), ("mask_embedding.pt", "file")} <= vllm


@pytest.mark.skipif(not (source_tree() / "convert_hf_to_gguf.py").is_file() and not os.environ.get("CI"),
                    reason="run `make setup` to unpack and build llama.cpp b11434")
def test_llamacpp_reads_the_drafter_config_not_the_targets():
    """The converter's DFlashModel reads the target's config.json too (`_target_uses_mrope`): not a drafter key."""
    assert column("llamacpp").root is not None
    assert reads_of("llamacpp", "mrope_section", "rope_parameters") == []
    assert [r.how for r in reads_of("llamacpp", "attention_value_scale", "dflash_config")] == ["get"]
    assert ("mask_embedding.pt", "file") in {(w.pattern, w.how) for w in column("llamacpp").weights}
    assert config_reads.column_record(column("llamacpp")) == json.loads(TABLE_JSON.read_text())["llamacpp"]
