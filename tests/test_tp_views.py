"""TensorView (models/tp_views.py): slicing reads just that slice; BF16 is widened to float32 exactly,
other dtypes come back as stored."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from offline_paged.models.tp_views import TensorView


def test_bf16_slice_is_widened_exactly():
    rng = np.random.default_rng(7)
    stored = rng.standard_normal((6, 10)).astype(ml_dtypes.bfloat16)
    view = TensorView(stored)
    assert view.shape == (6, 10) and view.ndim == 2
    got = view[2:5, 3:9]
    assert got.dtype == np.float32 and got.shape == (3, 6)
    np.testing.assert_array_equal(got, stored[2:5, 3:9].astype(np.float32))


def test_float_slice_keeps_its_dtype_and_is_a_copy():
    rng = np.random.default_rng(8)
    stored = rng.standard_normal((5, 4)).astype(np.float16)
    got = TensorView(stored)[1:4]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, stored[1:4])
    got[0, 0] += 1  # a copy: the checkpoint's view is never written through
    assert stored[1, 0] != got[0, 0]
