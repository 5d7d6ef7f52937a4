"""Loaders read the standard on-disk formats, written here byte for byte, and refuse bad files."""

import gzip
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from shoal.data import DataOptions, load_dataset
from shoal.errors import ShoalError


def write_idx(path, array: np.ndarray, gz: bool = False) -> None:
    """The IDX format of LeCun's MNIST files: magic (0, 0, type, ndim), big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def make_mnist(root, n_train=40, n_test=20, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 10,
    }
    for name, arr in arrays.items():
        write_idx(root / name, arr, gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx(tmp_path, gz):
    arrays = make_mnist(tmp_path, gz=gz)
    ds = load_dataset("mnist", DataOptions(data_dir=str(tmp_path)))
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert len(ds.train) == 40 and len(ds.test) == 20
    x, y = ds.train.get_batch(torch.arange(40))
    assert torch.equal(y, torch.from_numpy(arrays["train-labels-idx1-ubyte"]))
    # standardized with the training statistics, order of pixels preserved
    raw = torch.from_numpy(arrays["train-images-idx3-ubyte"]).float() / 255
    expected = (raw - raw.mean()) / raw.std()
    assert torch.allclose(x[:, 0], expected, atol=1e-5)


def test_fashion_mnist_in_torchvision_layout(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    make_mnist(raw)
    ds = load_dataset("fashion-mnist", DataOptions(data_dir=str(tmp_path)))
    assert len(ds.train) == 40


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"\x08\x08" + b[2:], "bad magic"),
    (lambda b: b[:-5], "holds"),
    (lambda b: b[:6], "truncated"),
])
def test_corrupt_idx_files_are_named(tmp_path, damage, message):
    make_mnist(tmp_path)
    target = tmp_path / "train-images-idx3-ubyte"
    target.write_bytes(damage(target.read_bytes()))
    with pytest.raises(ShoalError, match=message) as info:
        load_dataset("mnist", DataOptions(data_dir=str(tmp_path)))
    assert "train-images-idx3-ubyte" in str(info.value)


def test_missing_mnist_files_are_named(tmp_path):
    with pytest.raises(ShoalError, match="missing t10k-labels-idx1-ubyte"):
        make_mnist(tmp_path)
        (tmp_path / "t10k-labels-idx1-ubyte").unlink()
        load_dataset("mnist", DataOptions(data_dir=str(tmp_path)))
    with pytest.raises(ShoalError, match="needs --data-dir"):
        load_dataset("mnist", DataOptions())


def write_cifar(root, n=10, seed=0):
    """CIFAR-10's python batches: pickled dicts with byte-string keys (Python 2 origin)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"batch_label": name.encode(), b"labels": [int(v) for v in rng.integers(0, 10, n)],
                 b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"filenames": [f"{i}.png".encode() for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches[name] = batch
    return folder, batches


def test_cifar10_batches(tmp_path):
    _, batches = write_cifar(tmp_path)
    ds = load_dataset("cifar10", DataOptions(data_dir=str(tmp_path)))
    assert ds.input_shape == (3, 32, 32) and len(ds.train) == 50 and len(ds.test) == 10
    _, y = ds.test.get_batch(torch.arange(10))
    assert y.tolist() == batches["test_batch"][b"labels"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/shoal-pwned",))


def test_cifar_reader_refuses_code_in_pickles(tmp_path):
    folder, _ = write_cifar(tmp_path)
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}))
    with pytest.raises(ShoalError, match="refusing to load"):
        load_dataset("cifar10", DataOptions(data_dir=str(tmp_path)))
    assert not os.path.exists("/tmp/shoal-pwned")


def test_cifar_wrong_shape_is_named(tmp_path):
    folder, _ = write_cifar(tmp_path)
    bad = {b"data": np.zeros((3, 100), dtype=np.uint8), b"labels": [0, 1, 2]}
    (folder / "test_batch").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(ShoalError, match=r"test_batch: data must be uint8 of shape \(N, 3072\)"):
        load_dataset("cifar10", DataOptions(data_dir=str(tmp_path)))


def test_npz_arrays(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x_train=rng.normal(size=(30, 5)).astype("float32"), y_train=np.arange(30) % 3,
             x_test=rng.normal(size=(9, 5)).astype("float32"), y_test=np.arange(9) % 3)
    ds = load_dataset(f"npz:{path}")
    assert ds.input_shape == (5,) and ds.num_classes == 3
    x, _ = ds.train.get_batch(torch.arange(30))
    assert torch.allclose(x, torch.from_numpy(np.load(path)["x_train"]))  # floats used as given


def test_npz_problems_are_named(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.zeros(4, dtype=int))
    with pytest.raises(ShoalError, match="missing arrays x_test, y_test"):
        load_dataset(f"npz:{path}")
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.zeros(3, dtype=int),
             x_test=np.zeros((2, 2)), y_test=np.zeros(2, dtype=int))
    with pytest.raises(ShoalError, match="vector of 4"):
        load_dataset(f"npz:{path}")
    path.write_bytes(b"not a zip file")
    with pytest.raises(ShoalError, match="not a readable .npz"):
        load_dataset(f"npz:{path}")
    with pytest.raises(ShoalError, match="does not exist"):
        load_dataset(f"npz:{tmp_path / 'nope.npz'}")


def test_image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for cls in ("cat", "dog"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(d / f"{i}.png")
    ds = load_dataset(f"imagefolder:{tmp_path}")
    assert ds.input_shape == (3, 12, 10) and ds.num_classes == 2
    x, y = ds.train.get_batch(torch.tensor([0, 5]))
    assert x.shape == (2, 3, 12, 10) and y.tolist() == [0, 1]
    resized = load_dataset(f"imagefolder:{tmp_path}", DataOptions(image_size=8))
    assert resized.input_shape == (3, 8, 8)
    (tmp_path / "train" / "dog" / "1.png").write_bytes(b"garbage")
    with pytest.raises(ShoalError, match="dog/1.png: cannot decode image"):
        load_dataset(f"imagefolder:{tmp_path}")


def test_digits_are_scikit_learns_digits_and_split():
    """Read without importing scikit-learn, but exactly what its loader and split give."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        bunch.images.astype("float32") / 16, bunch.target, test_size=0.2, random_state=0,
        stratify=bunch.target)
    raw = load_dataset("digits", DataOptions())
    for split, y in ((raw.train, y_train), (raw.test, y_test)):
        assert torch.equal(split.y, torch.from_numpy(y.astype("int64")))
    # the inputs are standardized with the training statistics, as every dataset's are
    mean, std = x_train.mean(), x_train.std(ddof=1)
    for split, x in ((raw.train, x_train), (raw.test, x_test)):
        torch.testing.assert_close(split.x.squeeze(1), torch.from_numpy((x - mean) / std))


def test_digits_and_synthetic():
    digits = load_dataset("digits")
    assert (len(digits.train), len(digits.test), digits.input_shape) == (1437, 360, (1, 8, 8))
    syn = load_dataset("synthetic", DataOptions(synthetic_shape=(2, 4, 4), synthetic_classes=3,
                                                synthetic_samples=50))
    assert syn.input_shape == (2, 4, 4) and len(syn.train) == 50 and len(syn.test) == 10
    x, y = syn.train.get_batch(torch.arange(50))
    assert y.max() < 3 and x.shape == (50, 2, 4, 4)


def test_unknown_dataset_lists_choices():
    with pytest.raises(ShoalError, match="unknown dataset 'imagenet'.*digits"):
        load_dataset("imagenet")
