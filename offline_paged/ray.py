"""Ray Data integration at its public path: `ds.map_batches(Processor, ...)`, one engine per actor.

    from offline_paged.ray import Processor

Re-exports only (the processor lives in offline_paged/job/ray.py). Nothing here imports Ray, and
`import offline_paged` does not import this module; `pip install 'offline-paged[ray]'` installs Ray.
"""
from offline_paged.job.ray import Processor

__all__ = ["Processor"]
