"""The lm-evaluation-harness backend at its public path; importing it registers the model type "offline-paged".

    import offline_paged.lm_eval  # registers model="offline-paged"
    lm_eval.simple_evaluate(model="offline-paged", model_args="pretrained=DIR", tasks=[...])

Re-exports only (the backend lives in offline_paged/entrypoints/lm_eval.py). Needs lm-eval
(`pip install 'offline-paged[eval]'`); `import offline_paged` never imports it.
"""
from offline_paged.entrypoints.lm_eval import OfflinePagedLM

__all__ = ["OfflinePagedLM"]
