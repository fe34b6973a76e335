"""kvik: a self-hostable LLM serving stack.

`from kvik import LLM, SamplingParams` gives the offline engine API. The heavy names are imported
lazily so that torch-free parts (the gateway, the protocol schemas) never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvik.engine.llm",
    "AsyncLLM": "kvik.engine.async_llm",
    "EngineArgs": "kvik.core.config",
    "SamplingParams": "kvik.core.sampling_params",
    "RequestOutput": "kvik.core.outputs",
    "CompletionOutput": "kvik.core.outputs",
    "PoolingParams": "kvik.core.pooling_params",
    "PoolingRequestOutput": "kvik.core.outputs",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover  (names served lazily by __getattr__)
    from kvik.core.config import EngineArgs  # noqa: F401
    from kvik.core.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput  # noqa: F401
    from kvik.core.pooling_params import PoolingParams  # noqa: F401
    from kvik.core.sampling_params import SamplingParams  # noqa: F401
    from kvik.engine.async_llm import AsyncLLM  # noqa: F401
    from kvik.engine.llm import LLM  # noqa: F401


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvik' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
