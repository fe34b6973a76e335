"""Passes over a finished, loaded model (gpt-fast's lesson): the model files know nothing of them.

`optimize_for_inference` (before the KV cache exists) and `bind_kv_cache` (after) are the entry
points; see kvik.model.transforms.optimize.
"""

from kvik.model.transforms.optimize import (CacheBinding, TransformReport, bind_kv_cache,
                                            optimize_for_inference)

__all__ = ["CacheBinding", "TransformReport", "bind_kv_cache", "optimize_for_inference"]
