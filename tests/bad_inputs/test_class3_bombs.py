"""Class 3, hangs and memory blow-ups from small files: YAML alias bombs (list and dict), `${...}` reference
bombs and pickle reference bombs are refused in one line, within a few seconds, with the limits checked
before anything expands them."""

from __future__ import annotations

import time

import torch

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

SECONDS = 20  # a refusal, not a walk over 10**9 nodes (each case takes well under a second here)


def lightning_run(root, state, config_text):
    """A Lightning layout: version_0/hparams.yaml above checkpoints/last.ckpt."""
    folder = root / "lightning_logs" / "version_0"
    (folder / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": state}, folder / "checkpoints" / "last.ckpt")
    (folder / "hparams.yaml").write_text(config_text)
    return folder / "checkpoints" / "last.ckpt"


def list_bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def dict_bomb() -> str:
    lines = ["d0: &d0 {k0: x, k1: x, k2: x, k3: x, k4: x, k5: x, k6: x, k7: x, k8: x, k9: x}"]
    lines += [f"d{i}: &d{i} {{{', '.join(f'k{j}: *d{i - 1}' for j in range(10))}}}" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def reference_bomb() -> str:
    lines = ["r0: [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"r{i}: [" + ", ".join(['"${r' + str(i - 1) + '}"'] * 10) + "]" for i in range(1, 12)]
    return "\n".join(lines) + "\n"


def compare_ours(world, ours, tmp_path):
    return ["compare", "--ours", ours, "--ref", world / "zref", "--out", tmp_path / "report"]


def timed(argv, capsys):
    started = time.monotonic()
    code, _, err = run(argv, capsys)
    assert time.monotonic() - started < SECONDS, err
    return code, err


def state_of(world):
    return torch.load(world / "plain.pt", weights_only=True)["model"]


def test_yaml_alias_bombs_are_refused_before_expansion(world, tmp_path, capsys):
    for name, text, why in (("list", list_bomb(), "alias bomb"), ("dict", dict_bomb(), "alias bomb"),
                            ("refs", reference_bomb(), "references expand")):
        ckpt = lightning_run(tmp_path / name, state_of(world), text)
        before = tree_digest(tmp_path / name)
        code, err = timed(compare_ours(world, ckpt, tmp_path / name), capsys)
        assert_refused(code, err, "hparams.yaml", why)
        assert tree_digest(tmp_path / name) == before


def test_a_recursive_or_deep_yaml_is_refused(world, tmp_path, capsys):
    for name, text, why in (("loop", "a: &a [*a]\n", "recursive alias"),
                            ("deep", "a: " + "[" * 3000 + "]" * 3000 + "\n", "nested deeper")):
        ckpt = lightning_run(tmp_path / name, state_of(world), text)
        code, err = timed(compare_ours(world, ckpt, tmp_path / name), capsys)
        assert_refused(code, err, "hparams.yaml", why)


def reference_bomb_object(depth: int = 40):
    node: list = ["leaf"]
    for _ in range(depth):
        node = [node, node]
    return node


def test_pickle_reference_bombs_are_refused_at_once(world, tmp_path, capsys):
    state = state_of(world)
    loop: list = []
    loop.append(loop)
    bombs = {"list-bomb.pt": {"model": state, "args": reference_bomb_object()},
             "dict-bomb.ckpt": {"state_dict": state, "hyper": {"a": reference_bomb_object(), "b": 1}},
             "loop.pt": {"model": state, "args": loop}}
    for name, payload in bombs.items():
        torch.save(payload, tmp_path / name)
        code, err = timed(compare_ours(world, tmp_path / name, tmp_path), capsys)
        assert_refused(code, err, name, "refusing")


def test_our_own_checkpoint_with_a_bomb_inside_is_refused(world, tmp_path, capsys):
    payload = torch.load(world / "ours.pt", weights_only=True)
    payload["training_state"] = reference_bomb_object()
    torch.save(payload, tmp_path / "bomb.pt")
    code, err = timed(compare_ours(world, tmp_path / "bomb.pt", tmp_path), capsys)
    assert_refused(code, err, "bomb.pt", "reference bomb")


def test_a_parquet_decompression_bomb_and_wrong_columns_are_one_line(world, tmp_path, capsys):
    """A prompt set of 64 rows whose one dictionary value is 32 MiB: a few KiB on disk, 2 GiB decoded; refused by
    its decoded size, row by row, before it is held. A parquet of other columns, or given as a plain prompts file,
    is named too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    question = pa.DictionaryArray.from_arrays(pa.array([0] * 64, pa.int32()), pa.array(["a" * (32 << 20)]))
    pq.write_table(pa.table({"question": question, "answer": pa.array(["1"] * 64)}), tmp_path / "bomb.parquet",
                   compression="zstd")
    pq.write_table(pa.table({"text": ["x", "y"]}), tmp_path / "columns.parquet")
    assert (tmp_path / "bomb.parquet").stat().st_size < 1 << 20
    before = tree_digest(tmp_path)
    evaluate = ["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--max-new-tokens", "4"]
    for prompts, why in ((f"gsm8k:{tmp_path / 'bomb.parquet'}", "decompression bomb"),
                         (f"gsm8k:{tmp_path / 'columns.parquet'}", "needs a 'question' field"),
                         (tmp_path / "columns.parquet", "NAME:PATH")):
        code, err = timed(evaluate + ["--prompts", prompts], capsys)
        assert_refused(code, err, str(prompts).split(":")[-1], why)
    assert tree_digest(tmp_path) == before
