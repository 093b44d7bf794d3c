"""Stable dtype names: every supported dtype round-trips; anything else is refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from replay_proto.dtype_names import ITEMSIZES, check_dtype_name
from replay_proto.dtypes import (
    DTYPES,
    bits_dtype,
    dtype_from_name,
    dtype_name,
    numpy_dtype,
    numpy_view,
    tensor_view,
)


@pytest.mark.parametrize("name", list(DTYPES))
def test_name_round_trips_through_its_dtype(name: str) -> None:
    assert dtype_name(dtype_from_name(name)) == name


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_dtype_round_trips_through_its_name(dtype: torch.dtype) -> None:
    assert dtype_from_name(dtype_name(dtype)) is dtype


def test_names_are_the_torch_dtype_names() -> None:
    assert all(str(dtype) == f"torch.{name}" for name, dtype in DTYPES.items())


def test_every_name_maps_to_a_distinct_dtype() -> None:
    assert len(set(DTYPES.values())) == len(DTYPES)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.quint8])
def test_unsupported_dtype_raises_value_error_naming_it(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"dtype {dtype} is not supported"):
        dtype_name(dtype)


def test_unsupported_dtype_message_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="supported dtypes: bool, uint8, .*float64"):
        dtype_name(torch.complex64)


@pytest.mark.parametrize("name", ["float128", "complex64", "Float32", "torch.float32", ""])
def test_unknown_name_raises_value_error_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"unknown dtype name {name!r}")):
        dtype_from_name(name)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_numpy_views_share_memory_and_view_back_bit_for_bit(dtype: torch.dtype) -> None:
    tensor = (torch.linspace(-3, 3, 6) if dtype.is_floating_point else torch.arange(6) % 2).to(dtype)
    array = numpy_view(tensor)
    assert array.dtype == numpy_dtype(dtype) and array.nbytes == tensor.nbytes
    back = tensor_view(array, dtype)
    assert back.dtype is dtype and torch.equal(back, tensor)
    assert back.data_ptr() == tensor.data_ptr()


def test_bfloat16_is_int16_bits_for_numpy() -> None:
    assert bits_dtype(torch.bfloat16) is torch.int16 and bits_dtype(torch.float16) is torch.float16
    value = torch.tensor([1.5], dtype=torch.bfloat16)
    assert numpy_view(value).tolist() == [value.view(torch.int16).item()]


@pytest.mark.parametrize("name", list(DTYPES))
def test_each_declared_itemsize_is_torchs(name: str) -> None:
    # ITEMSIZES (torch-free: check-config's promised bytes come from it) states what torch
    # allocates per element, for every dtype a table may store, and lists no other dtype.
    assert ITEMSIZES[name] == torch.empty((), dtype=DTYPES[name]).element_size()
    assert list(ITEMSIZES) == list(DTYPES)


def test_an_unknown_dtype_name_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype name 'float8'; supported dtypes: "
                                         r"bool, uint8, .*float64"):
        check_dtype_name("float8")
