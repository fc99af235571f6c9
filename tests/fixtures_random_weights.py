"""Random weights for realistic shapes, shared by the GPU tests (importable without cupy)."""
from __future__ import annotations

import numpy as np

from offline_paged.models.config import LlamaConfig
from offline_paged.models.weight_spec import expected_weight_shapes


def random_weights(config: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """O(1) activations in every layer and peaked logits (a real model's margins), so a wrong kernel
    shows up as disagreement rather than hiding in near-ties."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        w = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * w
        elif name.endswith(".bias"):
            w *= 0.5
        elif "embed_tokens" not in name and name != "lm_head.weight":
            w /= np.sqrt(shape[-1])
        weights[name] = w
    return weights
