"""Class 6, valid inputs refused or left broken: a Hugging Face hub cache snapshot (relative links into
`../../blobs/`) is read for targets and drafters; a damaged offline-cache file is rebuilt with a line saying
so; two concurrent converts to one destination end in a clean result or a clean refusal; torch's weights-only
advice gives way to its reason."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_audit.formats import load_any
from foundation import atomic
from tests.bad_inputs.cli_run import CLASS_NAME, assert_refused, run

REPO = Path(__file__).resolve().parents[2]


def hub_cache(source: Path, root: Path, repo: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """`source`'s files laid out as huggingface_hub's cache does (file_download.py): each file's content in
    `blobs/<sha256>`, `snapshots/<revision>/<name>` a relative link `../../blobs/<sha256>`, `refs/main`."""
    cache = root / f"models--{repo.replace('/', '--')}"
    (cache / "blobs").mkdir(parents=True)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(revision)
    snapshot = cache / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        (cache / "blobs" / digest).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/{digest}")
    return snapshot


def sharded(source: Path, dest: Path) -> Path:
    """`source` (a z-lab drafter) with its weights in two shards and an index, as large checkpoints are saved."""
    dest.mkdir()
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, dest / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for extra in source.iterdir():
        if extra.name != "model.safetensors":
            (dest / extra.name).write_bytes(extra.read_bytes())
    return dest


def test_a_hub_cache_snapshot_is_read_for_drafters_and_targets(world, tmp_path, capsys):
    drafter = hub_cache(sharded(world / "zref", tmp_path / "zref-sharded"), tmp_path / "hub", "z-lab/drafter")
    target = hub_cache(world / "target", tmp_path / "hub", "org/target")
    assert all(p.is_symlink() for p in drafter.iterdir())
    assert load_any(drafter).spec == load_any(world / "zref").spec
    code, _, err = run(["compare", "--ours", world / "zref", "--ref", drafter, "--target", target,
                        "--prompts", world / "prompts.jsonl", "--max-new-tokens", "4", "--out", tmp_path / "r"],
                       capsys)
    assert code == 0, err
    code, out, err = run(["eval", "--drafter", drafter, "--target", target, "--prompts", world / "prompts.jsonl",
                          "--max-new-tokens", "4"], capsys)
    assert code == 0 and "mean τ" in out, err


def test_a_snapshot_link_out_of_the_cache_is_still_refused(world, tmp_path, capsys):
    drafter = hub_cache(sharded(world / "zref", tmp_path / "zref-sharded"), tmp_path / "hub", "z-lab/drafter")
    shard = drafter / "model-00001-of-00002.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    code, _, err = run(["compare", "--ours", world / "zref", "--ref", drafter, "--out", tmp_path / "r"], capsys)
    assert_refused(code, err, "model.safetensors.index.json", "outside")


def eval_offline(world, cache, capsys):
    return run(["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
                world / "prompts.jsonl", "--max-new-tokens", "4", "--mode", "offline", "--cache-dir", cache], capsys)


def test_a_truncated_offline_cache_is_rebuilt_with_a_line(world, tmp_path, capsys):
    cache = tmp_path / "cache"
    code, first, err = eval_offline(world, cache, capsys)
    assert code == 0, err
    (entry,) = (cache / "offline").glob("*.safetensors")
    layer = next(entry.with_suffix(".layers").glob("*.safetensors"))
    for damaged in (entry, layer):
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
        code, again, err = eval_offline(world, cache, capsys)
        assert code == 0, err
        assert "damaged" in err and damaged.name in err and "rebuilding" in err
        assert again.splitlines()[-3:] == first.splitlines()[-3:]  # the same τ from the rebuilt cache
        code, _, err = eval_offline(world, cache, capsys)
        assert code == 0 and "damaged" not in err  # rebuilt whole, read as it is from then on


def test_two_concurrent_converts_to_one_destination_end_cleanly(world, tmp_path):
    dest = tmp_path / "z"
    argv = [sys.executable, "-m", "dflash_audit.cli", "convert", "--from", str(world / "ours.pt"), "--to", str(dest),
            "--format", "zlab"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        procs = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for _ in range(2)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        for p in procs:
            p.stdout.close()
            p.stderr.close()
        assert any(code == 0 for code, _ in results), results
        for code, err in results:
            assert code in (0, 2), err
            if code == 2:
                assert_refused(code, err, str(dest))
        assert load_any(dest).spec == load_any(world / "zref").spec
        assert not (tmp_path / atomic.TMP_DIR).exists()
        argv.append("--force")  # the second round replaces the first's drafter, both at once


def test_torchs_weights_only_advice_gives_way_to_the_reason(world, tmp_path, capsys):
    class Call:
        def __reduce__(self):
            return (os.system, ("true",))

    payload = torch.load(world / "ours.pt", weights_only=True)
    payload["training_state"] = {"hook": Call()}
    torch.save(payload, tmp_path / "hooked.pt")
    code, _, err = run(["compare", "--ours", tmp_path / "hooked.pt", "--ref", world / "zref", "--out",
                        tmp_path / "r"], capsys)
    line = assert_refused(code, err, "hooked.pt", "system")
    assert "\x1b" not in line and "Weights only load failed" not in line and "trust" not in line
    assert not CLASS_NAME.search(line)


def large_settings(folder: Path, state: dict) -> Path:
    """A big run's checkpoint folder: a 60 MB args.json listing its data shards and a Hydra-style config.yaml past
    the old 1 MiB bound with more values than an alias bomb's limit, each declaring settings among what the audit
    never reads."""
    folder.mkdir()
    torch.save({"model": state}, folder / "last.pt")
    bucket = "s3://team-datasets/" + "/".join(["distillation-mixture-v3"] * 12)
    shards = [f"{bucket}/train-{i:07d}.jsonl" for i in range(200_000)]
    (folder / "args.json").write_text(json.dumps({"block_size": 4, "gamma": 7.0, "data_files": shards}))
    yaml_lines = ["model:", "  mask_token_id: 3", "data:", "  files:"] + [f"  - s{i}" for i in range(130_000)]
    (folder / "config.yaml").write_text("\n".join(yaml_lines) + "\n")
    return folder / "last.pt"


def test_large_settings_files_are_read_and_one_past_the_bound_is_set_aside(world, tmp_path, capsys):
    state = torch.load(world / "plain.pt", weights_only=True)["model"]
    ckpt = large_settings(tmp_path / "run", state)
    assert (tmp_path / "run" / "args.json").stat().st_size > 60e6
    assert (tmp_path / "run" / "config.yaml").stat().st_size > 1 << 20
    loaded = load_any(ckpt)
    assert (loaded.known_spec["block_size"], loaded.known_spec["mask_token_id"]) == (4, 3)
    assert loaded.provenance["block_size"].detail.startswith("args.json"), loaded.provenance
    assert loaded.provenance["mask_token_id"].detail.startswith("config.yaml"), loaded.provenance
    assert loaded.recipe.gamma == 7.0

    # Past the bound (a sparse file: its size, never its bytes, is what is read), the audit runs without it.
    (tmp_path / "run" / "config.yaml").unlink()
    (tmp_path / "run" / "args.json").unlink()
    with open(tmp_path / "run" / "args.json", "wb") as sparse:
        sparse.truncate(300 << 20)
    code, out, err = run(["compare", "--ours", ckpt, "--ref", world / "zref", "--out", tmp_path / "report"], capsys)
    assert code in (0, 1), err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    notes = [f["message"] for f in report["findings"] if f["key"] == "set aside in ours: args.json"]
    assert notes == ["ours: args.json beside the checkpoint: 314,572,800 bytes, past the 256 MiB a settings file is "
                     "read to: set aside unread, what it declares stays unknown."], notes
    assert "args.json" not in json.dumps(report["ours"].get("provenance", {})), "an unread file declares nothing"
