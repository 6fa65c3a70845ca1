"""Data registry: shapes and dtypes, seeded streams, epochs, microbatch splits, user files, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from pdcli.config.schema import DataConfig
from pdcli.data import DATASETS, Batch, build_data, list_datasets
from pdcli.data.synthetic import BOS_TOKEN
from pdcli.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is faster than two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def source(name: str, batch_size: int = 8, seed: int = 0, **kwargs: Any):
    """The training split; a file set trains on the whole file (its held-out split: the same file)."""
    eval_path = kwargs.get("path") if name in ("tensor_file", "token_file") else None
    return build_data(DataConfig(name=name, kwargs=kwargs, seed=seed, eval_path=eval_path), batch_size)


def shapes(batch: Batch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in (*batch.inputs, batch.target)]


# --- built-in sets ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("synthetic_images", {"channels": 2, "image_size": 5, "num_classes": 3},
         [((6, 2, 5, 5), torch.float32), ((6,), torch.int64)]),
        ("synthetic_tokens", {"vocab_size": 30, "seq_len": 9},
         [((6, 9), torch.int64), ((6, 9), torch.int64)]),
        ("synthetic_seq2seq", {"vocab_size": 30, "seq_len": 7},
         [((6, 7), torch.int64), ((6, 7), torch.int64), ((6, 7), torch.int64)]),
        ("digits", {}, [((6, 64), torch.float32), ((6,), torch.int64)]),
        ("digits", {"flatten": False, "split": "test"}, [((6, 1, 8, 8), torch.float32), ((6,), torch.int64)]),
    ],
)
def test_builtin_set_shapes_and_dtypes(name: str, kwargs: dict[str, Any], expected: list) -> None:
    src = source(name, batch_size=6, **kwargs)
    assert shapes(src.batch(0)) == expected
    assert shapes(src.batch(1000)) == expected
    assert src.describe().startswith(name)


@pytest.mark.parametrize("name", ["synthetic_images", "synthetic_tokens", "synthetic_seq2seq", "digits"])
def test_stream_is_a_function_of_seed_and_index(name: str) -> None:
    a, b = source(name, seed=1), source(name, seed=1)
    assert a.batch(5).equal(b.batch(5))  # two processes build the same stream on their own
    assert a.batch(5).equal(a.batch(5))
    assert not a.batch(5).equal(a.batch(6))
    assert not a.batch(5).equal(source(name, seed=2).batch(5))


@pytest.mark.parametrize("name", ["synthetic_images", "synthetic_tokens", "synthetic_seq2seq", "digits"])
def test_target_only_batches_have_the_same_target(name: str) -> None:
    """The last stage asks for the target alone; it must be the target the first stage's
    full batch carries, and images skip drawing their inputs."""
    src = source(name, seed=3)
    for index in (0, 7):
        full, target_only = src.batch(index), src.batch(index, with_inputs=False)
        assert torch.equal(target_only.target, full.target)
        assert target_only.inputs == () if name == "synthetic_images" else target_only.equal(full)
    parts = src.batch(2, with_inputs=False).split(2)  # the runtime splits it into microbatches
    assert torch.equal(torch.cat([p.target for p in parts]), src.batch(2).target)


def test_synthetic_sets_are_infinite_and_digits_is_finite() -> None:
    assert source("synthetic_images").num_examples is None
    train, everything = (source("digits", split=s).num_examples for s in ("train", "all"))
    test = build_data(DataConfig(name="digits", kwargs={"split": "train"}), 8, split="eval").num_examples
    assert train + test == 1797 and test == round(0.2 * 1797)
    assert everything == 1797 - round(0.1 * 1797)  # split=all trains on all but data.eval_fraction


def test_every_data_set_has_a_held_out_split_disjoint_from_training(tmp_path: Path) -> None:
    from pdcli.data.registry import num_eval_batches, steps_for_epochs

    def rows(src, num_batches: int) -> set[bytes]:
        return {row.numpy().tobytes() for t in range(num_batches) for row in src.batch(t).inputs[0]}

    cfg = DataConfig(name="digits", kwargs={"split": "train"})
    train, held_out = build_data(cfg, 64), build_data(cfg, 64, split="eval")
    assert held_out.num_examples == round(0.2 * 1797) and num_eval_batches(held_out, None) == 359 // 64
    assert not rows(train, 23) & rows(held_out, 5)
    assert steps_for_epochs(train, 2) == -(-2 * 1438 // 64)
    tokens = np.arange(201, dtype="uint16")
    tokens.tofile(tmp_path / "tokens.bin")
    windows = DataConfig(name="token_file", kwargs={"path": str(tmp_path / "tokens.bin"), "seq_len": 10})
    assert (build_data(windows, 2).num_examples, build_data(windows, 2, split="eval").num_examples) == (18, 2)
    everything = DataConfig(name="digits", kwargs={"split": "all"}, eval_fraction=0.25)
    train, held_out = build_data(everything, 8), build_data(everything, 8, split="eval")
    assert (train.num_examples, held_out.num_examples) == (1797 - 449, 449)
    assert not rows(train, 1348 // 8) & rows(held_out, 449 // 8)
    assert torch.equal(held_out.batch(0).target, build_data(everything, 8, split="eval").batch(0).target)  # fixed
    images = DataConfig(name="synthetic_images", kwargs={"image_size": 4})
    train, held_out = build_data(images, 8), build_data(images, 8, split="eval")
    assert num_eval_batches(held_out, None) == 8 and num_eval_batches(held_out, 3) == 3
    assert not torch.equal(train.batch(0).inputs[0], held_out.batch(0).inputs[0])
    with pytest.raises(UserError, match="train.epochs: the data set is an infinite"):
        steps_for_epochs(train, 1)
    with pytest.raises(UserError, match="data.eval_path: digits has no held-out file"):
        build_data(DataConfig(name="digits", eval_path="x.pt"), 8, split="eval")


def test_a_file_set_reads_its_held_out_file(tmp_path) -> None:
    torch.save({"inputs": torch.randn(10, 3), "target": torch.arange(10)}, tmp_path / "train.pt")
    torch.save({"inputs": torch.randn(6, 3), "target": torch.arange(6) + 100}, tmp_path / "eval.pt")
    cfg = DataConfig(name="tensor_file", kwargs={"path": str(tmp_path / "train.pt")}, eval_path=str(tmp_path / "eval.pt"))
    assert build_data(cfg, 2).num_examples == 10
    assert build_data(cfg, 2, split="eval").batch(0).target.tolist() == [100, 101]


def test_digits_split_is_fixed_and_disjoint() -> None:
    def rows(split: str, seed: int) -> set[bytes]:
        src = source("digits", batch_size=1797, seed=seed, split=split)
        return {row.numpy().tobytes() for row in src.batch(0).inputs[0]}

    train = rows("train", 0)
    assert train == rows("train", 7)  # data.seed reorders, never re-splits
    assert not train & rows("test", 0)
    assert all(0.0 <= v <= 1.0 for v in source("digits", batch_size=32).batch(0).inputs[0].flatten().tolist())


@pytest.mark.slow
def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from pdcli.data import digits as digits_module

    bunch = load_digits()
    pixels, labels = digits_module.digits_table()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target) and labels.dtype == np.int64
    # a worker loading the data does not pay scikit-learn's import
    code = "import sys; from pdcli.data.digits import digits; digits(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-1000:]
    # where the table is not where scikit-learn ships it, load_digits reads it
    monkeypatch.setattr(digits_module, "SHIPPED_TABLE", tmp_path / "nowhere.csv.gz")
    fallback_pixels, fallback_labels = digits_module.digits_table()
    assert np.array_equal(fallback_pixels, bunch.data) and np.array_equal(fallback_labels, bunch.target)


def test_synthetic_images_carry_a_class_signal() -> None:
    src = source("synthetic_images", batch_size=64, num_classes=4, image_size=8, channels=1)
    train = [src.batch(i) for i in range(4)]
    images = torch.cat([b.inputs[0] for b in train]).flatten(1)
    labels = torch.cat([b.target for b in train])
    means = torch.stack([images[labels == c].mean(0) for c in range(4)])
    held_out = src.batch(100)
    predicted = torch.cdist(held_out.inputs[0].flatten(1), means).argmin(1)
    assert (predicted == held_out.target).float().mean() > 0.9  # chance is 0.25


def test_synthetic_tokens_follow_the_rule_and_target_is_shifted_input() -> None:
    src = source("synthetic_tokens", batch_size=32, vocab_size=50, seq_len=20, max_step=3, noise_prob=0.05)
    (tokens,), target = src.batch(0).inputs, src.batch(0).target
    assert torch.equal(tokens[:, 1:], target[:, :-1])
    steps = (target - tokens) % 50
    on_rule = ((steps >= 1) & (steps <= 3)).float().mean()
    assert on_rule > 0.8
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 50


def test_synthetic_seq2seq_reverses_with_bos_teacher_forcing() -> None:
    batch = source("synthetic_seq2seq", vocab_size=30, seq_len=7).batch(3)
    src, tgt_in = batch.inputs
    assert torch.equal(batch.target, src.flip(1))
    assert (tgt_in[:, 0] == BOS_TOKEN).all()
    assert torch.equal(tgt_in[:, 1:], batch.target[:, :-1])
    assert (src != BOS_TOKEN).all()
    copy = source("synthetic_seq2seq", vocab_size=30, seq_len=7, reverse=False).batch(3)
    assert torch.equal(copy.target, copy.inputs[0])


# --- finite sets: epochs ----------------------------------------------------------


def tensor_set(tmp_path: Path, num_examples: int) -> Path:
    path = tmp_path / "set.pt"
    inputs = torch.arange(num_examples, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    torch.save({"inputs": inputs, "target": torch.arange(num_examples)}, path)
    return path


def test_each_epoch_is_a_permutation_and_batches_wrap_around(tmp_path: Path) -> None:
    src = source("tensor_file", batch_size=4, seed=3, path=str(tensor_set(tmp_path, 10)))
    assert src.num_examples == 10
    stream = torch.cat([src.batch(i).target for i in range(5)]).tolist()  # 20 positions = 2 epochs
    first, second = stream[:10], stream[10:]
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second  # each epoch has its own order
    inputs = torch.cat([src.batch(i).inputs[0] for i in range(5)])
    assert torch.equal(inputs[:, 0].long(), torch.tensor(stream))  # rows stay paired with targets


def test_a_batch_larger_than_the_set_still_has_batch_size_rows(tmp_path: Path) -> None:
    src = source("tensor_file", batch_size=7, path=str(tensor_set(tmp_path, 3)))
    assert src.batch(2).num_samples == 7


# --- microbatches -----------------------------------------------------------------


def test_split_into_microbatches_keeps_order() -> None:
    batch = source("synthetic_seq2seq", batch_size=8, vocab_size=30, seq_len=5).batch(0)
    parts = batch.split(4)
    assert len(parts) == 4 and all(p.num_samples == 2 and len(p.inputs) == 2 for p in parts)
    assert torch.equal(torch.cat([p.target for p in parts]), batch.target)
    assert torch.equal(torch.cat([p.inputs[1] for p in parts]), batch.inputs[1])
    with pytest.raises(ValueError, match=r"cannot split a batch of 8 samples into 3 equal"):
        batch.split(3)


def test_batch_to_device_keeps_contents() -> None:
    batch = source("synthetic_seq2seq", batch_size=2, vocab_size=30, seq_len=5).batch(0)
    moved = batch.to("cpu")
    assert moved.equal(batch) and moved is not batch


def test_batch_rejects_tensors_of_different_lengths() -> None:
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        Batch(inputs=(torch.zeros(2, 4),), target=torch.zeros(3))


# --- user files -------------------------------------------------------------------


def test_tensor_file_pt_dict_with_several_inputs(tmp_path: Path) -> None:
    path = tmp_path / "pair.pt"
    torch.save(
        {"inputs": [torch.randn(6, 2, dtype=torch.float64), torch.ones(6, 3, dtype=torch.int32)],
         "target": torch.zeros(6, dtype=torch.int32)},
        path,
    )
    batch = source("tensor_file", batch_size=3, path=str(path)).batch(0)
    assert shapes(batch) == [((3, 2), torch.float32), ((3, 3), torch.int64), ((3,), torch.int64)]


def test_tensor_file_npz_and_separate_npy_files(tmp_path: Path) -> None:
    np.savez(tmp_path / "set.npz", inputs=np.zeros((5, 4)), target=np.arange(5))
    assert shapes(source("tensor_file", batch_size=2, path=str(tmp_path / "set.npz")).batch(0)) == [
        ((2, 4), torch.float32), ((2,), torch.int64)]
    np.save(tmp_path / "x.npy", np.ones((5, 1, 2, 2), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.ones((5, 3), dtype=np.float32))
    batch = source("tensor_file", batch_size=2, path=str(tmp_path / "x.npy"), target_path=str(tmp_path / "y.npy")).batch(1)
    assert shapes(batch) == [((2, 1, 2, 2), torch.float32), ((2, 3), torch.float32)]


def test_tensor_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(UserError, match=rf"data.kwargs.path: file not found: {missing}"):
        source("tensor_file", path=str(missing))
    torch.save(torch.zeros(3), tmp_path / "plain.pt")
    with pytest.raises(UserError, match=r"must hold a dict with keys 'inputs' and 'target'"):
        source("tensor_file", path=str(tmp_path / "plain.pt"))
    with pytest.raises(UserError, match=rf"data.kwargs.target_path: file not found: {tmp_path / 'y.pt'}"):
        source("tensor_file", path=str(tmp_path / "plain.pt"), target_path=str(tmp_path / "y.pt"))
    torch.save({"inputs": torch.zeros(3, 2), "target": torch.zeros(4)}, tmp_path / "bad.pt")
    with pytest.raises(UserError, match=r"same number of examples .* \[3, 4\]"):
        source("tensor_file", path=str(tmp_path / "bad.pt"))
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(UserError, match=r"is not one of .pt, .npy, .npz"):
        source("tensor_file", path=str(tmp_path / "x.csv"))
    (tmp_path / "garbage.pt").write_bytes(b"not a tensor")
    with pytest.raises(UserError, match=r"data.kwargs.path: cannot read"):
        source("tensor_file", path=str(tmp_path / "garbage.pt"))


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_token_file_windows(tmp_path: Path, dtype: str) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(101, dtype=dtype).tofile(path)
    src = source("token_file", batch_size=4, path=str(path), seq_len=10, dtype=dtype)
    assert src.num_examples == 10  # (101 - 1) // 10 windows of 11 tokens
    seen = set()
    for i in range(3):
        batch = src.batch(i)
        (tokens,), target = batch.inputs, batch.target
        assert shapes(batch) == [((4, 10), torch.int64), ((4, 10), torch.int64)]
        assert torch.equal(tokens[:, 1:], target[:, :-1])
        assert torch.equal(target[:, -1], tokens[:, -1] + 1)
        assert (tokens[:, 0] % 10 == 0).all()  # windows start at multiples of seq_len
        seen.update(tokens[:, 0].tolist())
    assert seen == set(range(0, 100, 10))


def test_token_file_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=rf"data.kwargs.path: file not found: {tmp_path / 'x.bin'}"):
        source("token_file", path=str(tmp_path / "x.bin"))
    short = tmp_path / "short.bin"
    np.arange(5, dtype=np.uint16).tofile(short)
    with pytest.raises(UserError, match=r"has 5 tokens, fewer than seq_len \+ 1 = 11"):
        source("token_file", path=str(short), seq_len=10)
    with pytest.raises(UserError, match=r"data.kwargs.dtype: 'float32' is not one of"):
        source("token_file", path=str(short), dtype="float32")
    with pytest.raises(UserError, match=r"10 bytes, not a multiple of 4 \(int32\)"):
        source("token_file", path=str(short), dtype="int32", seq_len=1)
    with pytest.raises(UserError, match=r"data.kwargs.path: token_file needs a path"):
        source("token_file")


# --- registry errors and config groups ---------------------------------------------


def test_unknown_data_set_and_kwarg_suggest_close_matches() -> None:
    with pytest.raises(UserError) as info:
        source("digit")
    assert info.value.message == "data.name: unknown data set 'digit'; did you mean digits?"
    assert all(name in info.value.hint for name in DATASETS)
    with pytest.raises(UserError) as info:
        source("synthetic_tokens", vocab=10)
    assert info.value.message.startswith("data.kwargs.vocab: unknown argument of synthetic_tokens; did you mean")
    assert "vocab_size" in info.value.message


def test_bad_values_are_user_errors() -> None:
    with pytest.raises(UserError, match=r"data.kwargs.seq_len: expected int .* got str"):
        source("synthetic_tokens", seq_len="8")
    with pytest.raises(UserError, match=r"data.kwargs: digits split must be one of train, test, all, got 'val'"):
        source("digits", split="val")
    with pytest.raises(UserError, match=r"data.seed: must be >= 0, got -1"):
        source("digits", seed=-1)
    with pytest.raises(ValueError, match=r"batch index must be >= 0"):
        source("synthetic_images").batch(-1)


def test_list_datasets_covers_the_registry() -> None:
    listed = list_datasets()
    assert [name for name, _ in listed] == list(DATASETS)
    assert all(doc and "\n" not in doc for _, doc in listed)


@pytest.mark.parametrize("data_file", sorted((CONFIGS / "data").glob("*.yaml")), ids=lambda p: p.stem)
def test_data_config_group_builds(data_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CONFIGS.parent)  # file paths in the groups are relative to the repository root
    content = yaml.safe_load(data_file.read_text())
    cfg = DataConfig(**content)
    assert cfg.name == data_file.stem
    src = build_data(cfg, cfg.batch_size)
    assert src.batch(0).num_samples == cfg.batch_size
    assert cfg.batch_size % 4 == 0  # splits into the default 4 microbatches
