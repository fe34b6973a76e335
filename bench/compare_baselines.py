#!/usr/bin/env python
"""kvik against HF transformers on the same random-weight model and prompts, in one run.

    python bench/compare_baselines.py                      # the reference: 125M Llama, 64 requests
    python bench/compare_baselines.py --num-requests 16    # shorter
    python bench/compare_baselines.py --model DIR --systems kvik,hf-static

Writes the reference model (`kvik make-model --size bench`) on first use. Same as `kvik bench compare`.
"""

from __future__ import annotations

import sys

from kvik.cli.bench import compare_main

if __name__ == "__main__":
    sys.exit(compare_main(sys.argv[1:]))
