"""--outer-precision's codecs against hand-written references: round trips, int4's packing,
the bytes each sends, error feedback over rounds, and the compressed sum on real Gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shoal
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.processes import spawn
from shoal.core.quantize import CHUNK, Codec, CompressedMean, check_precision, error_feedback
from shoal.errors import ShoalError

SCALED = {"int8": 127, "int4": 7}


def reference_scaled(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Symmetric round-to-nearest integer codes, one float32 scale (largest magnitude /
    levels) per run of CHUNK values; what the receiver reads back."""
    x = x.float()
    out = torch.empty_like(x)
    for lo in range(0, len(x), CHUNK):
        part = x[lo:lo + CHUNK]
        scale = part.abs().max() / levels
        scale = scale if scale > 0 else torch.tensor(1.0)
        out[lo:lo + CHUNK] = torch.clamp(torch.round(part / scale), -levels, levels) * scale
    return out


def sample(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=gen)]
    x[n // 2] = 0.0
    return x


@pytest.mark.parametrize("n", [2, 7, CHUNK, 3 * CHUNK + 5])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_integer_codes_match_the_reference(precision, n):
    x = sample(n)
    codec = Codec(precision)
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.payload_bytes(n)
    assert torch.equal(codec.decode(message, n), reference_scaled(x, SCALED[precision]))


def test_int4_packs_two_codes_a_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, 3.0])  # scale 1: codes 7, -7, 0, 1, 3
    message = Codec("int4").encode(x)
    codes = message[4:]  # after one float32 scale
    assert message[:4].view(torch.float32).item() == 1.0
    assert codes.tolist() == [(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((1 + 8) << 4), 3 + 8]


@pytest.mark.parametrize("precision, bound", [("bf16", 2.0 ** -8), ("fp8", 2.0 ** -3)])
def test_float_codes_round_within_their_precision(precision, bound):
    x = sample(1000)
    codec = Codec(precision)
    back = codec.decode(codec.encode(x), len(x))
    if precision == "bf16":
        assert torch.equal(back, x.to(torch.bfloat16).float())
    # fp8 (e4m3) keeps 3 mantissa bits for values within 2^-6 of their chunk's largest
    big = torch.cat([x[i:i + CHUNK].abs() > 2.0 ** -6 * x[i:i + CHUNK].abs().max()
                     for i in range(0, len(x), CHUNK)])
    rel = (back - x).abs()[big] / x.abs()[big]
    assert rel.max() <= bound, (precision, rel.max())


def test_fp32_is_the_vector_itself():
    x = sample(10)
    codec = Codec("fp32")
    assert codec.encode(x) is x and codec.decode(x, 10) is x


def test_int4_sends_at_least_seven_times_fewer_bytes_than_fp32():
    n = 1_900_000
    assert Codec("fp32").payload_bytes(n) / Codec("int4").payload_bytes(n) >= 7
    assert Codec("fp32").payload_bytes(n) / Codec("int8").payload_bytes(n) >= 3.9


def test_error_feedback_matches_the_reference_over_rounds():
    """e <- (x + e) - Q(x + e): what is sent over R rounds sums to what was meant minus the
    last residual, so no error piles up (and without feedback it does)."""
    codec = Codec("int4")
    residual = torch.zeros(600)
    ref_e = torch.zeros(600)
    sent, meant = torch.zeros(600), torch.zeros(600)
    alone = Comm(Environment(), torch.device("cpu"))
    for r in range(20):
        x = sample(600, seed=r) * 0.01 + 0.003  # a bias that rounding alone would drop
        got = CompressedMean(alone, codec, x, "t", residual=residual).wait()
        expected = reference_scaled(x + ref_e, 7)
        ref_e = (x + ref_e) - expected
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(residual, ref_e, rtol=0, atol=0)
        sent += got
        meant += x
    torch.testing.assert_close(sent, meant - residual, rtol=0, atol=1e-5)
    no_feedback = sum(reference_scaled(sample(600, seed=r) * 0.01 + 0.003, 7) for r in range(20))
    assert (no_feedback - meant).abs().max() > 3 * (sent - meant).abs().max()


def test_bad_names_are_one_line():
    with pytest.raises(ShoalError, match="--outer-precision must be one of fp32, bf16, fp8, int8, int4"):
        check_precision("fp16")
    with pytest.raises(ShoalError, match="--error-feedback must be auto, on or off"):
        error_feedback("int4", "yes")
    assert error_feedback("int4", "auto") and not error_feedback("bf16", "auto")
    assert error_feedback("fp32", "on") and not error_feedback("int8", "off")


# -- on real ranks ---------------------------------------------------------------------------
def sums_on_ranks(out_dir: str) -> None:
    comm = shoal.init(device="cpu")
    found = {}
    for precision in ("fp32", "bf16", "fp8", "int8", "int4"):
        x = sample(700, seed=10 + comm.rank)
        before = comm.bytes_sent
        got = CompressedMean(comm, Codec(precision), x.clone(), precision).wait()
        found[precision] = {"sum": got.tolist(), "bytes": comm.bytes_sent - before,
                            "in_flight": comm.in_flight}
    found["peak"] = comm.peak_in_flight
    Path(out_dir, f"rank{comm.rank}.json").write_text(json.dumps(found))
    shoal.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_mean_on_real_ranks(tmp_path, world):
    """Every rank gets the same mean: the decoded messages of all ranks, summed in rank
    order (all-gathered where a sum of codes would overflow); each sends its own message."""
    spawn(world, sums_on_ranks, (str(tmp_path),))
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    xs = [sample(700, seed=10 + r) for r in range(world)]
    for precision in ("fp32", "bf16", "fp8", "int8", "int4"):
        codec = Codec(precision)
        decoded = [codec.decode(codec.encode(x), 700) for x in xs]
        if precision in SCALED:
            expected = sum(decoded[1:], decoded[0].clone()) / world
            tol = 0.0
        else:
            expected = sum(xs) / world
            tol = 1e-6 if precision == "fp32" else 2e-2
        for rank in range(world):
            got = torch.tensor(found[rank][precision]["sum"])
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol * 10)
            assert got.tolist() == found[0][precision]["sum"], "every rank the same"
            assert found[rank][precision]["bytes"] == codec.payload_bytes(700)
            assert found[rank][precision]["in_flight"] == 0
    assert found[0]["peak"] == 4 * 700
