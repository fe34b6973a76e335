"""Transparent huge pages for what a decode step streams: the KV pool and the model's weights.

A decode step reads every weight once, in long sequential runs. With 4 KiB pages each run takes a
TLB miss every 4 KiB; with 2 MiB pages every 2 MiB. On the 2-core AVX-512 reference machine (Linux
THP in `madvise` mode, which most distributions ship) kvik's streaming read of 70-400 MB went from
30-43 GB/s on 4 KiB pages to 34-72 GB/s on 2 MiB ones; the decode kernels gained less (int8 and
int4 single-stream decode 3-14 %, bfloat16 within the noise: docs/quantization.md). llama.cpp gets
them for its mmapped GGUF file where the page cache has large folios; PyTorch's allocator only asks
for them with THP_MEM_ALLOC_ENABLE=1, and then only for single tensors of 2 MiB and more, which
leaves out most of a small model's projections.

`advise_huge_pages` marks a tensor's memory before its pages are touched; `move_to_huge_pages`
copies a loaded model's weights into advised arenas and points each tensor at its copy in place
(`tensor.data = copy`), so every holder of the tensor, the compiled kernels' included, reads the
copy. Best effort throughout: without THP (other systems, `never`) nothing changes but the copy.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

HUGE_PAGE = 2 * 2**20
ARENA_BYTES = 64 * 2**20  # weights are packed into arenas this big (a larger tensor gets its own)
MIN_TENSOR_BYTES = 64 * 2**10  # smaller tensors (norm weights, biases) stay where they are
_ALIGN = 4096  # each tensor starts on a page of its own: the kernels' vector loads want 64


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with transparent huge pages (MADV_HUGEPAGE), before its
    pages are first touched: the 2 MiB-aligned part of its memory. Best effort: False where
    unsupported."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        start = (tensor.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) & ~(HUGE_PAGE - 1)
        if end <= start:
            return False
        madv_hugepage = 14
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_hugepage) == 0
    except (OSError, AttributeError):
        return False


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of `nbytes` whose memory is advised for huge pages, starting
    on a 2 MiB boundary (the allocation is padded by one huge page to get there)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE
    buffer = raw[offset:offset + nbytes]
    advise_huge_pages(buffer)
    return buffer


def _movable(tensor: torch.Tensor) -> bool:
    """A dense CPU tensor that is the whole of its storage, big enough to matter."""
    nbytes = tensor.numel() * tensor.element_size()
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.is_contiguous() and tensor.storage_offset() == 0 and nbytes >= MIN_TENSOR_BYTES
            and tensor.untyped_storage().nbytes() == nbytes)


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy `model`'s parameters and buffers of MIN_TENSOR_BYTES and more into huge-page arenas, in
    module order (the order a forward reads them). A tensor whose storage another parameter or
    buffer also uses (a view of another weight) stays where it is, so it stays shared; one Parameter
    held by two modules (tied weights) moves once. Storage shared with a tensor outside the module
    tree (a plain attribute) is not seen: such a tensor would keep the old copy. Returns the bytes
    moved."""
    tensors: list[torch.Tensor] = []
    owners: dict[int, int] = {}  # storage address -> distinct tensors on it
    seen: set[int] = set()
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is None or id(tensor) in seen or tensor.device.type != "cpu":
                continue
            seen.add(id(tensor))
            if tensor.layout == torch.strided and not tensor.is_quantized:
                address = tensor.untyped_storage().data_ptr()
                owners[address] = owners.get(address, 0) + 1
            if _movable(tensor):
                tensors.append(tensor)
    tensors = [t for t in tensors if owners[t.untyped_storage().data_ptr()] == 1]
    moved = 0
    arena, used = None, 0
    with torch.no_grad():
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > ARENA_BYTES:
                slot = huge_page_empty(nbytes)
            else:
                if arena is None or used + nbytes > arena.numel():
                    arena, used = huge_page_empty(ARENA_BYTES), 0
                slot = arena[used:used + nbytes]
                used += -(-nbytes // _ALIGN) * _ALIGN
            copy = slot.view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            tensor.data = copy
            moved += nbytes
    return moved
