"""The DLPack protocol of hot._C: import (versioned and legacy producers, read-only flag, consumed
capsules, deleters) and export (hot._C.Array)."""
import ctypes
import sys

import numpy as np
import pytest

import hot
from hot import _C

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]


def capsule_name(cap) -> str:
    return _get_name(cap).decode()


class LegacyProducer:
    """A pre-1.0 producer: __dlpack__ knows no max_version (TypeError), gives a 'dltensor' capsule."""

    def __init__(self, a):
        self.a = a
        self.shape, self.dtype = a.shape, a.dtype
        self.calls = []

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def __dlpack__(self, stream=None):
        self.calls.append(stream)
        return self.a.__dlpack__(stream=stream)  # numpy, asked without max_version: legacy capsule


def test_versioned_import_and_strides():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1:5]
    d = _C._inspect(a)
    assert d["capsule"] == "dltensor_versioned" and d["version"][0] == 1
    assert d["shape"] == (4, 4) and d["strides"] == (6, 1) and d["dtype"] == "float32" and d["device"] == "cpu"


def test_legacy_producer_is_retried_without_max_version():
    p = LegacyProducer(np.ones((3, 4), np.float32))
    d = _C._inspect(p)
    assert d["capsule"] == "dltensor"
    assert p.calls == [None]  # CPU: stream=None
    q, s = hot.quantize(LegacyProducer(np.full((2, 4), 2.0, np.float32)))
    assert (q == 127).all() and s[0] == pytest.approx(2.0 / 127)


def test_consumed_capsule_is_renamed_and_refused_twice():
    a = np.ones((2, 2), np.float32)
    cap = a.__dlpack__(max_version=(1, 0))
    assert capsule_name(cap) == "dltensor_versioned"
    _C._inspect(cap)
    assert capsule_name(cap) == "used_dltensor_versioned"
    with pytest.raises(ValueError, match="capsule named 'used_dltensor_versioned'"):
        _C._inspect(cap)
    legacy = a.__dlpack__()
    _C._inspect(legacy)
    assert capsule_name(legacy) == "used_dltensor"


def test_deleter_runs_when_the_view_is_done():
    """numpy's DLPack export holds a reference to the array until the deleter runs."""
    a = np.ones((64, 64), np.float32)
    before = sys.getrefcount(a)
    for _ in range(3):
        _C._inspect(a)
        hot.quantize(a)
    assert sys.getrefcount(a) == before
    with pytest.raises(TypeError):
        _C._inspect(np.ones((2, 2), np.float64))  # failed imports release too
    b = np.ones((2, 2), np.float64)
    before = sys.getrefcount(b)
    with pytest.raises(TypeError):
        _C._inspect(b)
    assert sys.getrefcount(b) == before


def test_read_only_inputs_are_fine_read_only_outputs_are_refused():
    x = np.ones((4, 8), np.float32)
    x.flags.writeable = False
    assert _C._inspect(x)["read_only"]
    q, s = hot.quantize(x)  # read-only input: fine
    ro_q = np.empty((4, 8), np.int8)
    ro_q.flags.writeable = False
    with pytest.raises(ValueError, match="quantize: q is read-only"):
        _C.quantize(x, ro_q, np.empty(1, np.float32), 8, "tensor", "nearest", 0, 0, 0)


def test_wrong_output_shape_or_dtype_is_refused():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="q"):
        _C.quantize(x, np.empty((4, 7), np.int8), np.empty(1, np.float32), 8, "tensor", "nearest", 0, 0, 0)
    with pytest.raises(TypeError, match="quantize: q has dtype int32"):
        _C.quantize(x, np.empty((4, 8), np.int32), np.empty(1, np.float32), 8, "tensor", "nearest", 0, 0, 0)


@pytest.mark.parametrize("max_version,name", [(None, "dltensor"), ((0, 8), "dltensor"),
                                              ((1, 0), "dltensor_versioned"), ((1, 5), "dltensor_versioned"),
                                              ((2, 0), "dltensor_versioned")])
def test_array_export_capsule_kind(max_version, name):
    arr = _C.hadamard_transform(np.ones((3, 16), np.float32), None, 16, 1, 1, 0)
    assert isinstance(arr, _C.Array)
    assert arr.__dlpack_device__() == (1, 0)
    assert arr.shape == (3, 16) and arr.dtype == "float32" and arr.device == "cpu"
    cap = arr.__dlpack__(max_version=max_version)
    assert capsule_name(cap) == name
    d = _C._inspect(cap)
    assert d["strides"] == (16, 1)  # always filled
    if name == "dltensor_versioned":
        assert d["version"] == (1, 0 if max_version == (1, 0) else 1) and not d["read_only"]
    del cap  # a consumed capsule must not free twice; an unconsumed one frees through its destructor
    arr.__dlpack__()  # dropped unconsumed


def test_array_export_to_numpy_and_torch_shares_and_keeps_memory_alive():
    arr = _C.hadamard_transform(np.arange(32, dtype=np.float32).reshape(2, 16), None, 1, 1, 1, 0)
    a = np.from_dlpack(arr)
    del arr
    np.testing.assert_array_equal(a, np.arange(32, dtype=np.float32).reshape(2, 16))
    torch = pytest.importorskip("torch")
    arr = _C.hadamard_transform(np.ones((2, 16), np.float32), None, 1, 1, 1, 0)
    t = torch.from_dlpack(arr)
    del arr
    assert t.shape == (2, 16) and float(t.sum()) == 32.0


def test_array_export_refuses_bad_requests():
    arr = _C.hadamard_transform(np.ones((3, 16), np.float32), None, 16, 1, 1, 0)
    with pytest.raises(BufferError):
        arr.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        arr.__dlpack__(stream=5)
    c = np.from_dlpack(arr, copy=True)  # numpy asks with copy=True
    assert c.shape == (3, 16)


def test_packed_int4_exchanged_as_uint8():
    q = np.array([[1, -2, 3, -8, 7, 0]], np.int8)
    p = _C.pack_int4(q, None, 0)
    assert p.shape == (1, 3) and p.dtype == "uint8"
    np.testing.assert_array_equal(np.from_dlpack(p), hot.pack_int4(q))
    d = _C._inspect(hot.pack_int4(q))
    assert d["dtype"] == "int4 (packed)" and d["shape"] == (1, 6)


def test_bfloat16_is_kdlbfloat():
    torch = pytest.importorskip("torch")
    d = _C._inspect(torch.ones(2, 3, dtype=torch.bfloat16))
    assert d["dtype"] == "bfloat16"
    out = hot.hadamard_transform(torch.ones(2, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.float32


def test_torch_non_contiguous_leading_dims_error_names_argument():
    torch = pytest.importorskip("torch")
    x = torch.ones(4, 6, 8).transpose(0, 1)  # leading dims not flattenable without a copy
    with pytest.raises(ValueError, match="compress_activation: x .*contiguous"):
        hot.compress_activation(x)
    hot.compress_activation(x.contiguous())


@pytest.mark.parametrize("view", ["columns", "reversed_rows"])
def test_array_copy_of_a_strided_wrapped_array_is_exactly_its_elements(view):
    """copy=True of an Array over a strided framework array (a SavedActivation wrapping a column slice, or rows in
    reverse) copies the view's elements, compactly, not a contiguous block from its first address."""
    base = (np.arange(64 * 4096) % 251 - 125).astype(np.int8).reshape(64, 4096)
    q = base[:, 8:24] if view == "columns" else base[::-1, :16]
    s = _C.SavedActivation.wrap(q, np.ones(1, np.float32), 4, 4, 8, 0)
    c = np.from_dlpack(s.q, copy=True)
    np.testing.assert_array_equal(c, q)
    assert c.flags.c_contiguous and c.flags.writeable and not np.shares_memory(c, base)
    assert s.q.nbytes == q.size


def test_array_over_read_only_memory_is_exported_read_only():
    """A SavedActivation wrapping read-only arrays hands them out read-only (versioned DLPack flag), refuses the
    legacy capsule that could not say so, and a copy is writable."""
    q = np.zeros((4, 16), np.int8)
    q.flags.writeable = False
    s = _C.SavedActivation.wrap(q, np.ones(1, np.float32), 4, 4, 8, 0)
    a = np.from_dlpack(s.q)
    assert not a.flags.writeable and np.shares_memory(a, q)
    with pytest.raises(ValueError):
        a[0, 0] = 1
    with pytest.raises(BufferError, match="read-only"):
        s.q.__dlpack__()
    assert _C._inspect(s.q.__dlpack__(max_version=(1, 0)))["read_only"]
    c = np.from_dlpack(s.q, copy=True)
    c[0, 0] = 1
    assert q[0, 0] == 0
    assert np.from_dlpack(s.scale).flags.writeable  # scale was writable


@pytest.mark.parametrize("split", [100000000, 3, -3])
def test_split_out_of_range_is_a_value_error(split):
    with pytest.raises(ValueError, match=f"hadamard_transform: split must be -1 or in 0..2 .*got {split}"):
        _C.hadamard_transform(np.ones((32, 64), np.float32), None, 16, split, 1, 0)
