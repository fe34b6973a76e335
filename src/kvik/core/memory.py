"""Handing freed heap memory back to the operating system."""

from __future__ import annotations


def release_freed_memory() -> None:
    """glibc keeps heap memory a large job freed for reuse, so a long-lived process that once
    handled a multi-megabyte request (its body, its parsed copy, millions of token ids, the
    tokenizer's buffers) keeps that RSS forever; malloc_trim returns it. Costs a few ms: call it
    after large jobs only. A no-op where glibc is not the allocator."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
