"""Compressed averages: what the periodic strategies send, in fewer bits.

``--outer-precision`` picks a :class:`Codec`; :class:`CompressedMean` encodes a vector (with
error feedback), starts one collective on the job's :class:`~shoal.core.comm.Comm` and, when
waited for, returns the decoded sum or mean in float32.

- ``fp32``: the vector itself, summed by an all-reduce (today's message, bit for bit).
- ``bf16``: cast to bfloat16 and summed by an all-reduce in bfloat16 (half the bytes).
- ``fp8``, ``int8``, ``int4``: per-chunk scaled (one float32 scale per :data:`CHUNK` values,
  the chunk's largest magnitude over the code's range), rounded to nearest. A sum of such
  codes would overflow and mix scales, so each rank's payload (scales and codes, as bytes) is
  all-gathered and every rank decodes and sums all of them locally, in rank order: every rank
  gets the same float32 sum. ``int4`` packs two codes (``-7..7``, stored ``+8``) per byte.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error feedback fixes SignSGD"):
what rounding dropped this round, ``e = (x + e) - decode(encode(x + e))``, is kept on the
rank and added to what it sends next round, so the errors do not pile up in one direction.
It is the known remedy for biased compressors and on by default for ``fp8``, ``int8`` and
``int4`` (:data:`ERROR_FEEDBACK`); ``--error-feedback on|off`` overrides it.
"""

from __future__ import annotations

import torch

from shoal.errors import ShoalError

#: ``--outer-precision`` values.
PRECISIONS = ("fp32", "bf16", "fp8", "int8", "int4")
#: Whether each precision keeps an error-feedback residual by default.
ERROR_FEEDBACK = {"fp32": False, "bf16": False, "fp8": True, "int8": True, "int4": True}
#: Values that share one float32 scale in the scaled codes.
CHUNK = 256
#: The largest code magnitude of each scaled precision.
RANGES = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}


def check_precision(name: str, flag: str = "--outer-precision") -> str:
    """``name`` if it is a precision; a one-line error otherwise."""
    if name not in PRECISIONS:
        raise ShoalError(f"{flag} must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return name


def error_feedback(precision: str, setting: str) -> bool:
    """Whether to keep a residual: ``setting`` ``on``/``off``, or ``auto`` (the default of
    ``precision``); a one-line error for anything else."""
    if setting not in ("auto", "on", "off"):
        raise ShoalError(f"--error-feedback must be auto, on or off, got {setting!r}")
    return ERROR_FEEDBACK[precision] if setting == "auto" else setting == "on"


class Codec:
    """How one precision turns a float32 vector into a message and back.

    ``reduces``: the message can be summed by an all-reduce (``fp32``, ``bf16``); otherwise
    the messages are all-gathered and decoded one by one.
    """

    def __init__(self, precision: str) -> None:
        self.precision = check_precision(precision)
        self.reduces = precision in ("fp32", "bf16")
        self.range = RANGES.get(precision, 0.0)

    def payload_bytes(self, n: int) -> int:
        """Bytes of the message for ``n`` values."""
        if self.precision == "fp32":
            return 4 * n
        if self.precision == "bf16":
            return 2 * n
        chunks = -(-n // CHUNK)
        codes = (n + 1) // 2 if self.precision == "int4" else n
        return 4 * chunks + codes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message for the 1-D float32 ``x`` (``fp32``: ``x`` itself, not a copy)."""
        if self.precision == "fp32":
            return x
        if self.precision == "bf16":
            return x.to(torch.bfloat16)
        n = x.numel()
        padded = torch.zeros(-(-n // CHUNK) * CHUNK, dtype=torch.float32, device=x.device)
        padded[:n] = x
        chunks = padded.view(-1, CHUNK)
        scales = chunks.abs().amax(dim=1) / self.range
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        scaled = (chunks / scales[:, None]).reshape(-1)[:n]
        if self.precision == "fp8":
            codes = scaled.clamp(-self.range, self.range).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            ints = scaled.round().clamp(-self.range, self.range).to(torch.int16)
            codes = (ints.to(torch.int8).view(torch.uint8) if self.precision == "int8"
                     else pack_nibbles(ints + 8))
        return torch.cat([scales.view(torch.uint8), codes])

    def decode(self, message: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 values of a message of ``n`` values (``fp32``: the message itself)."""
        if self.precision == "fp32":
            return message
        if self.precision == "bf16":
            return message.float()
        chunks = -(-n // CHUNK)
        scales = message[:4 * chunks].clone().view(torch.float32)  # rows may start unaligned
        codes = message[4 * chunks:]
        if self.precision == "fp8":
            values = codes.view(torch.float8_e4m3fn).float()
        elif self.precision == "int8":
            values = codes.view(torch.int8).float()
        else:
            values = (unpack_nibbles(codes, n) - 8).float()
        return values * scales.repeat_interleave(CHUNK)[:n]


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """``values`` in 0..15, two per byte: the even-indexed one in the low four bits."""
    v = values.to(torch.uint8)
    if v.numel() % 2:
        v = torch.cat([v, v.new_zeros(1)])
    return v[0::2] | (v[1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` values of :func:`pack_nibbles`, as int16."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]
    return out.to(torch.int16)


class CompressedMean:
    """One compressed sum (or mean) over every rank of ``comm``, in flight.

    ``x`` (1-D float32) is encoded after adding ``residual`` (error feedback, updated here
    with what the encoding dropped; ``None``: none), and the message's collective starts at
    once, booked on ``comm`` under ``name``. :meth:`wait` returns the sum in ``x``'s dtype,
    divided by the world size when ``mean``. With ``fp32`` and no residual the collective reduces ``x``
    in place and the result is ``x`` itself, exactly as an all-reduce of it.
    """

    def __init__(self, comm, codec: Codec, x: torch.Tensor, name: str, *, mean: bool = True,
                 residual: torch.Tensor | None = None) -> None:
        self.comm, self.codec, self.n, self.mean = comm, codec, x.numel(), mean
        self.dtype = x.dtype  # the sum is taken in it (float64 models: float64)
        if residual is not None:
            x = x + residual
        message = codec.encode(x)
        if residual is not None:
            torch.sub(x, codec.decode(message, self.n), out=residual)
        if codec.reduces or not comm.active:
            self._handle = comm.all_reduce_async(message, "sum", name)
        else:
            self._handle = comm.all_gather_async(message, name)
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The decoded sum (mean) over every rank; waits for the collective once."""
        if self._result is None:
            got = self._handle.wait()
            if self.codec.reduces or not self.comm.active:
                total = self.codec.decode(got, self.n).to(self.dtype)
            else:
                total = self.codec.decode(got[0], self.n).to(self.dtype, copy=True)
                for row in got[1:]:
                    total.add_(self.codec.decode(row, self.n).to(self.dtype))
            if self.mean:
                total.div_(self.comm.world_size)
            self._result = total
        return self._result
