"""Labels and images are checked when a dataset loads, so bad data is one line before training.

The rule for labels (docs/data.md): integer class numbers (any int dtype, or whole-number
floats), the classes are 0..C-1 with C-1 the largest *training* label, every one of them has a
training sample, and every test label is one of them.
"""

import pickle
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch

from shoal.cli import main
from shoal.data import DataOptions, load_dataset
from shoal.errors import ShoalError

from conftest import one_error_line
from test_data import make_mnist, write_cifar, write_idx


def save_npz(path, y_train, y_test=None, n_test=6):
    """An npz of 8x8 uint8 images with these labels (test labels default to 0, 1, 2, ...)."""
    y_train = np.asarray(y_train)
    y_test = np.arange(n_test) % 3 if y_test is None else np.asarray(y_test)
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (len(y_train), 8, 8), dtype=np.uint8),
             y_train=y_train, x_test=rng.integers(0, 256, (len(y_test), 8, 8), dtype=np.uint8),
             y_test=y_test)
    return path


def npz_error(path) -> str:
    with pytest.raises(ShoalError) as info:
        load_dataset(f"npz:{path}")
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_stray_label_far_beyond_the_others_is_refused(tmp_path):
    y = np.r_[np.arange(39) % 3, 100000]
    message = npz_error(save_npz(tmp_path / "d.npz", y))
    assert "(y_train)" in message
    assert "no training sample for classes 3..99999" in message
    assert "0..2 with 13 samples each" in message and "100000 with 1 sample" in message


def test_class_without_training_sample_is_named(tmp_path):
    y = np.array([0, 1, 3, 4] * 5)  # class 2 missing
    message = npz_error(save_npz(tmp_path / "d.npz", y, y_test=[0, 1, 3]))
    assert "no training sample for class 2 " in message
    assert "0..1 with 5 samples each, 3..4 with 5 samples each" in message
    # no class 0 (labels 1..C, as e.g. EMNIST letters have): refused too, naming class 0
    message = npz_error(save_npz(tmp_path / "e.npz", np.arange(1, 21) % 3 + 1, y_test=[1, 2]))
    assert "no training sample for class 0 " in message
    # many gaps: counted, the first few listed
    message = npz_error(save_npz(tmp_path / "f.npz", np.arange(40) % 20 * 3, y_test=[0, 3]))
    assert "no training sample for 38 classes, namely 1..2, 4..5, 7..8, 10..11, 13..14 and " \
           "14 more gaps (labels found: 0 with 2 samples, 3 with 2 samples" in message


def test_test_only_classes_are_named(tmp_path):
    message = npz_error(save_npz(tmp_path / "d.npz", np.arange(12) % 3, y_test=[0, 3, 5, 5, 1]))
    assert "(y_test)" in message
    assert "classes 3 (1 sample), 5 (2 samples) never appear in training" in message
    assert "classes 0..2" in message


@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint16", "int32", "uint64", "float32",
                                   "float64"])
def test_any_integer_dtype_and_whole_floats_are_labels(tmp_path, dtype):
    path = save_npz(tmp_path / "d.npz", (np.arange(12) % 3).astype(dtype),
                    y_test=(np.arange(6) % 3).astype(dtype))
    ds = load_dataset(f"npz:{path}")
    assert ds.num_classes == 3
    _, y = ds.train.get_batch(torch.arange(12))
    assert y.dtype == torch.int64 and y.tolist() == (np.arange(12) % 3).tolist()


@pytest.mark.parametrize("labels, problem", [
    (np.array([0, 1, 2, 2**64 - 1] * 3, dtype=np.uint64),
     "label 18446744073709551615 at row 3 is too large to be a class number"),
    (np.array([0, 1, 2, 2**62] * 3, dtype=np.int64), "label 4611686018427387904 at row 3 is too"),
    (np.array([0, 1, -1, 2] * 3), "label -1 at row 2 is negative (3 negative labels)"),
    (np.array([0, 1, 2.5, 2] * 3), "label 2.5 at row 2 is not a whole number (3 such labels)"),
    (np.array([0, 1, np.nan, 2] * 3), "label nan at row 2 is not a whole number"),
    (np.array([0, 1, np.inf, 2] * 3, dtype=np.float32), "label inf at row 2 is not a whole"),
    (np.array([True, False] * 6), "labels are booleans"),
    (np.array(["cat", "dog", "emu"] * 4), "labels must be integer class numbers, got <U3"),
    (np.array([0, 1, 2, 1] * 3, dtype=np.complex64), "labels must be integer class numbers"),
])
def test_bad_label_values_and_dtypes_are_one_line(tmp_path, labels, problem):
    message = npz_error(save_npz(tmp_path / "d.npz", labels))
    assert f"(y_train): {problem}" in message


def test_mnist_label_files_are_checked(tmp_path):
    make_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.r_[np.arange(39) % 10, 200])
    with pytest.raises(ShoalError, match=r"train-labels-idx1-ubyte: no training sample for "
                                         r"classes 10\..199 .*200 with 1 sample"):
        load_dataset("mnist", DataOptions(data_dir=str(tmp_path)))
    make_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.r_[np.arange(19) % 10, 12])
    with pytest.raises(ShoalError, match=r"t10k-labels-idx1-ubyte: class 12 \(1 sample\) never "
                                         r"appears in training"):
        load_dataset("mnist", DataOptions(data_dir=str(tmp_path)))


def test_cifar_labels_are_checked_per_batch_file(tmp_path):
    folder, _ = write_cifar(tmp_path)
    bad = {b"data": np.zeros((3, 3072), dtype=np.uint8), b"labels": [0, -1, 2]}
    (folder / "data_batch_2").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(ShoalError, match=r"data_batch_2: label -1 at row 1 is negative"):
        load_dataset("cifar10", DataOptions(data_dir=str(tmp_path)))
    bad[b"labels"] = [0, "cat", 2]  # text in the pickled list: one line, not a ValueError
    (folder / "data_batch_2").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(ShoalError, match=r"data_batch_2: labels must be integer class numbers"):
        load_dataset("cifar10", DataOptions(data_dir=str(tmp_path)))


def make_image_folder(root, classes=("cat", "dog"), counts=(("train", 3), ("test", 2)), size=8):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in counts:
        for cls in classes:
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(d / f"{i}.png")
    return root


def folder_error(root) -> str:
    with pytest.raises(ShoalError) as info:
        load_dataset(f"imagefolder:{root}")
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_class_directory_is_named(tmp_path, split):
    make_image_folder(tmp_path)
    (tmp_path / split / "emu").mkdir()
    (tmp_path / split / "emu" / "notes.txt").write_text("no images here")
    if split == "test":
        make_image_folder(tmp_path, classes=("emu",), counts=(("train", 3),))
    message = folder_error(tmp_path)
    assert message.startswith(f"{tmp_path / split / 'emu'}: class directory holds no images")


def test_hidden_directories_are_not_classes(tmp_path):
    make_image_folder(tmp_path)
    (tmp_path / "train" / ".ipynb_checkpoints").mkdir()
    assert load_dataset(f"imagefolder:{tmp_path}").num_classes == 2


def test_every_image_is_decoded_before_training(tmp_path):
    make_image_folder(tmp_path)
    bad = tmp_path / "test" / "dog" / "1.png"
    bad.write_bytes(b"garbage")
    assert folder_error(tmp_path).startswith(f"{bad}: cannot decode image")
    make_image_folder(tmp_path / "b")
    truncated = tmp_path / "b" / "train" / "cat" / "2.png"
    truncated.write_bytes(truncated.read_bytes()[:-30])
    (tmp_path / "b" / "test" / "cat" / "0.png").write_bytes(b"")
    message = folder_error(tmp_path / "b")
    assert message.startswith(f"{truncated}: cannot decode image")
    assert message.endswith("(and 1 more unreadable image)")


def png_declaring(path, width: int, height: int) -> None:
    """A small valid PNG whose header claims ``width`` x ``height`` (CRC fixed up)."""
    from PIL import Image

    img_path = path.with_suffix(".tmp.png")
    Image.new("L", (8, 8)).save(img_path)
    data = bytearray(img_path.read_bytes())
    img_path.unlink()
    data[16:24] = struct.pack(">II", width, height)  # IHDR's width and height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("side", [20000, 10000])  # over twice Pillow's limit / just over it
def test_decompression_bomb_is_named(tmp_path, side):
    make_image_folder(tmp_path)
    bomb = tmp_path / "test" / "cat" / "1.png"
    png_declaring(bomb, side, side)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning must not leak
        message = folder_error(tmp_path)
    assert message.startswith(f"{bomb}: cannot decode image") and "decompression bomb" in message


def test_train_refuses_bad_labels_before_workers_start(tmp_path, capsys):
    # In-process: the command's code path, minus an interpreter start-up.
    path = save_npz(tmp_path / "d.npz", np.r_[np.arange(39) % 3, 100000])
    assert main(["train", "--model", "lenet5", "--dataset", f"npz:{path}", "--workers", "2",
                 "--out", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(path) in line and "no training sample for classes 3..99999" in line
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_train_refuses_a_corrupt_test_image_before_training(tmp_path, capfd):
    make_image_folder(tmp_path / "f")
    bad = tmp_path / "f" / "test" / "cat" / "0.png"
    bad.write_bytes(b"not a png")
    assert main(["train", "--model", "lenet5", "--dataset", f"imagefolder:{tmp_path / 'f'}",
                 "--workers", "2", "--epochs", "1", "--out", str(tmp_path / "run")]) == 2
    out, err = capfd.readouterr()  # a worker's output too, had one started
    assert one_error_line(err).startswith(f"shoal: error: {bad}: cannot decode image")
    assert "lenet5 on" not in out + err  # no worker started training
