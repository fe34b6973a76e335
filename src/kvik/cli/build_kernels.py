"""`kvik build-kernels`: compile the CPU kernels now (the install step runs it), not on first start."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "build-kernels", help="compile kvik's CPU kernels into the cache (done once per machine)",
        description="Compile kvik's C++ CPU kernels for this machine into the kernel cache "
                    "($KVIK_CACHE_DIR or ~/.cache/kvik), so that no `kvik serve` start waits for it. "
                    "Exits 0 without a compiler too: kvik then uses its plain PyTorch path. "
                    "Built for this CPU (-march=native) unless KVIK_CPU_KERNELS_MARCH names another "
                    "target (e.g. x86-64-v2 for machines without AVX2).")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from kvik.model.layers.cpu_kernels import cpu_kernels

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = cpu_kernels()
    if module is None:
        print("CPU kernels unavailable: kvik uses PyTorch")
    else:  # which vector code the weight-only (bfloat16/int8/int4) kernels were compiled to
        print(f"CPU kernels ready (weight-only kernels: {module.simd_isa()})")
    return 0
