"""Identity and metadata of a stored tensor."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_KEY_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-/]{1,200}$")

# Names written into swap-file headers; one byte code each keeps the header fixed-size.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True, order=True)
class TensorKey:
    """The name of a stored tensor, e.g. ``block.3/master``. Safe to use in a file name once '/' is mapped."""

    name: str

    def __post_init__(self) -> None:
        if not _KEY_PATTERN.match(self.name):
            raise ValueError(
                f"tensor key {self.name!r} is not valid: use 1-200 characters from letters, digits and _ . : - /"
            )

    def file_stem(self) -> str:
        """A file-system-safe stem for this key's swap file."""
        return self.name.replace("/", "__")

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TensorMeta:
    """What the store needs to know to hold a flat tensor: dtype and element count."""

    dtype: torch.dtype
    numel: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} is not supported by tierstore; use one of {sorted(map(str, DTYPE_CODES))}")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @property
    def nbytes(self) -> int:
        """Exact payload size in bytes."""
        return self.numel * self.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """The meta of an existing tensor (flattened)."""
        return cls(dtype=tensor.dtype, numel=tensor.numel())
