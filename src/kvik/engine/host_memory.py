"""glibc's malloc, told to keep a step's memory for the next step (CPU engines).

PyTorch's CPU allocator caches nothing: every tensor is a malloc and a free. glibc serves a block
at or over its mmap threshold (128 KiB, rising to at most 32 MiB as such blocks are freed) from
fresh pages it maps for it and unmaps on free, and it hands the heap's free top back to the kernel
past its trim threshold. So a prompt step faults its large activations in, 4 KiB at a time, in
every layer of every step: a 2048-token step's gate/up output on the reference model is 2048 x 4096
float32, 32 MiB, right at the ceiling. Measured on the 2-core reference machine (Zen 5, 2
threads): the reference model's int4 linears at 2048 rows ran at 0.69x their speed at 512 rows, and
at the same speed with the settings below; 16 prompts of 256 tokens prefill 1.33x faster
(`bench/prefill_memory.py`).

`keep_step_memory` raises both thresholds to 1 GiB once the model's weights and the KV pool are in
place (they keep the mmapped memory they were given, advised for huge pages where that applies), so
a step's tensors come from the heap and go back to it: the heap then holds on to up to a step's
peak of activations. llama.cpp plans its compute buffers once; vLLM's CPU backend asks users to
preload tcmalloc for the same reason. `KVIK_MALLOC_TUNING=0` keeps glibc's defaults; other C
libraries (musl) have no mallopt and are left as they are.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2**30


def keep_step_memory() -> bool:
    """Set glibc's mmap and trim thresholds to KEEP_BYTES for this process. True when they were set;
    False where turned off (KVIK_MALLOC_TUNING=0) or the C library is not glibc."""
    if os.environ.get("KVIK_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    if done:
        logger.debug("malloc: blocks under %d MiB now come from (and return to) the heap", KEEP_BYTES >> 20)
    return done
