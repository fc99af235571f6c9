"""BlockSwapper (ops/swap.py): whole KV blocks out to pinned host memory and back, bit-exact, in fp16 and
bf16. Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_launchers import DTYPES  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_out_and_in_round_trip_through_pinned_memory(dtype):
    from offline_paged.ops.swap import BlockSwapper

    rng = np.random.default_rng(3)
    kv = cupy.asarray(rng.standard_normal((2, 2, 12, 16, 2, 64)).astype(dtype))
    original = kv.get()
    swapper = BlockSwapper(kv, num_cpu_blocks=6)
    assert swapper.cpu_cache.dtype == dtype
    swapper.swap_out([3, 7, 11], [5, 0, 2])
    np.testing.assert_array_equal(swapper.cpu_cache[:, :, [5, 0, 2]].view(np.uint16),
                                  original[:, :, [3, 7, 11]].view(np.uint16))
    kv[:, :, [3, 7, 11]] = 0
    swapper.swap_in([5, 0, 2], [3, 7, 11])
    np.testing.assert_array_equal(kv.get().view(np.uint16), original.view(np.uint16))
