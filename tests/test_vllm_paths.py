"""vLLM's module paths (offline_paged.sampling_params, .inputs, .outputs, .pooling_params, .lora.request,
.distributed) hand out the very classes of the package, and LoRARequest checks its fields as vLLM does."""
from __future__ import annotations

import pytest

import offline_paged
from offline_paged import distributed, inputs, outputs, pooling_params, sampling_params
from offline_paged.lora.request import LoRARequest


def test_the_module_paths_re_export_the_package_classes():
    assert sampling_params.SamplingParams is offline_paged.SamplingParams
    assert sampling_params.BeamSearchParams is offline_paged.BeamSearchParams
    assert inputs.TokensPrompt is offline_paged.TokensPrompt and inputs.TextPrompt is offline_paged.TextPrompt
    assert outputs.RequestOutput is offline_paged.RequestOutput
    assert outputs.CompletionOutput is offline_paged.CompletionOutput
    assert pooling_params.PoolingParams().normalize is None
    for module in (sampling_params, inputs, outputs, pooling_params, distributed):
        assert all(hasattr(module, name) for name in module.__all__)
    assert sampling_params.RequestOutputKind.FINAL_ONLY.name == "FINAL_ONLY"


def test_lora_request_has_vllms_fields_and_checks_its_id():
    request = LoRARequest("sql", 2, "/adapters/sql")
    assert (request.name, request.adapter_id, request.path) == ("sql", 2, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("sql", 0, "/adapters/sql")


def test_cleanup_runs_without_a_gpu():
    distributed.cleanup_dist_env_and_memory()
