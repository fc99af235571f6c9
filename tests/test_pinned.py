"""PinnedUpload (ops/pinned.py) on the CPU, with a stand-in for CuPy's few calls: every upload's bytes
reach the device array; a staged buffer is not written again before `num_slots` later uploads (what
lets a copy still queued on the device read it); slots grow to fit. The real pinned copies run on a
GPU in the async engine tests (test_gpu_async.py)."""
from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

_MODULES = ("cupy", "offline_paged.ops.swap", "offline_paged.ops.pinned")


class _FakeDeviceArray:
    """cupy.empty's result: `set(host)` keeps the host view it was given, as a queued copy would."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.source = tuple(shape), np.dtype(dtype), None

    def set(self, host) -> None:
        assert host.shape == self.shape and host.dtype == self.dtype
        self.source = host  # not copied: the device reads it later


@pytest.fixture
def pinned():
    """offline_paged.ops.pinned imported against the stand-in; the real modules are put back after."""
    import offline_paged.ops as ops_package

    saved = {name: sys.modules.get(name) for name in _MODULES}
    saved_attrs = {name: getattr(ops_package, name, None) for name in ("swap", "pinned")}
    allocations = []

    def alloc_pinned_memory(nbytes):
        allocations.append(nbytes)
        return bytearray(nbytes)

    sys.modules["cupy"] = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory),
                                          empty=_FakeDeviceArray)
    for name in _MODULES[1:]:
        sys.modules.pop(name, None)
    try:
        module = importlib.import_module("offline_paged.ops.pinned")
        yield module, allocations
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
        for name, value in saved_attrs.items():
            if value is None:
                if hasattr(ops_package, name):
                    delattr(ops_package, name)
            else:
                setattr(ops_package, name, value)


def test_a_staged_buffer_is_untouched_for_num_slots_uploads(pinned):
    module, _ = pinned
    upload = module.PinnedUpload(num_slots=4)
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal((3, 7)).astype(np.float32) for _ in range(4)]
    outs = [upload(h) for h in hosts]
    for host, out in zip(hosts, outs):  # all four still readable: no slot reused yet
        np.testing.assert_array_equal(out.source, host)
    fifth = rng.standard_normal((3, 7)).astype(np.float32)
    upload(fifth)  # reuses the first slot, whose copy (one step old) has finished
    np.testing.assert_array_equal(outs[0].source, fifth)
    for host, out in zip(hosts[1:], outs[1:]):
        np.testing.assert_array_equal(out.source, host)


def test_upload_into_a_given_array_keeps_shape_dtype_and_bytes(pinned):
    module, _ = pinned
    upload = module.PinnedUpload(num_slots=2)
    host = np.random.default_rng(1).integers(-1000, 1000, size=(5, 2, 3)).astype(np.int32)[:, :, ::-1]
    out = _FakeDeviceArray(host.shape, host.dtype)
    assert upload(host, out=out) is out
    np.testing.assert_array_equal(out.source, host)  # a non-contiguous host array is staged contiguously


def test_slots_grow_to_fit_and_double(pinned):
    module, allocations = pinned
    upload = module.PinnedUpload(num_slots=1)
    rng = np.random.default_rng(2)
    upload(rng.standard_normal(10).astype(np.float32))  # 40 bytes: the 4 KiB minimum
    upload(rng.standard_normal(2000).astype(np.float64))  # 16,000 bytes: exactly that
    upload(rng.standard_normal(2100).astype(np.float64))  # 16,800 bytes: twice the slot
    small = rng.standard_normal(4).astype(np.float16)
    out = upload(small)  # fits: no new allocation
    assert allocations[1:] == [4096, 16_000, 32_000]  # allocations[0]: the empty slot at construction
    np.testing.assert_array_equal(out.source, small)
