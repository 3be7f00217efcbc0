"""TensorKey validation and file stems; TensorMeta sizes for every supported dtype."""

from __future__ import annotations

import pytest
import torch

from tierstore.keys import DTYPE_CODES, DTYPES_BY_CODE, TensorKey, TensorMeta


@pytest.mark.parametrize("name", ["a", "block.3/master", "layer_0:w-1", "x" * 200, "a/b/c"])
def test_valid_keys(name: str) -> None:
    key = TensorKey(name)
    assert str(key) == name
    assert "/" not in key.file_stem()


@pytest.mark.parametrize("name", ["", "x" * 201, "has space", "tab\t", "naïve", "a\\b", "a\x00b", "semi;colon"])
def test_invalid_keys_name_the_rule(name: str) -> None:
    with pytest.raises(ValueError, match="not valid"):
        TensorKey(name)


def test_file_stem_maps_slashes() -> None:
    assert TensorKey("block.3/master").file_stem() == "block.3__master"
    assert TensorKey("plain").file_stem() == "plain"


def test_keys_are_hashable_and_ordered() -> None:
    keys = [TensorKey("b"), TensorKey("a"), TensorKey("a")]
    assert sorted(set(keys)) == [TensorKey("a"), TensorKey("b")]


def test_dtype_codes_are_a_bijection() -> None:
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)
    assert all(DTYPES_BY_CODE[code] is dtype for dtype, code in DTYPE_CODES.items())


@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str), ids=str)
@pytest.mark.parametrize("numel", [0, 1, 4097])
def test_meta_nbytes_matches_torch(dtype: torch.dtype, numel: int) -> None:
    tensor = torch.zeros(numel, dtype=dtype)
    meta = TensorMeta.of(tensor)
    assert meta == TensorMeta(dtype, numel)
    assert meta.itemsize == tensor.element_size()
    assert meta.nbytes == tensor.numel() * tensor.element_size()


def test_meta_of_flattens() -> None:
    assert TensorMeta.of(torch.zeros(3, 5, dtype=torch.float16)) == TensorMeta(torch.float16, 15)


def test_unsupported_dtype_and_negative_numel_are_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        TensorMeta(torch.complex64, 4)
    with pytest.raises(ValueError, match=">= 0"):
        TensorMeta(torch.float32, -1)
