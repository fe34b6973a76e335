"""Eight tiny LoRA adapters trained by `kvik train` on the tiny Llama, shared by the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.lora.helpers import ALL_TARGETS, CHAT_TOPICS, train_adapter

# Ranks and targets vary so that zero-padding to --max-lora-rank and partial targets (pieces of
# the fused q/k/v and gate/up projections left at zero) are exercised.
ADAPTER_SPECS = [
    (2, ["q_proj", "v_proj"]),
    (4, ALL_TARGETS),
    (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    (4, ["gate_proj", "up_proj", "down_proj"]),
    (6, ["k_proj", "o_proj", "down_proj"]),
    (8, ALL_TARGETS),
    (2, ["up_proj", "v_proj"]),
    (4, ["q_proj", "gate_proj"]),
]


@pytest.fixture(scope="session")
def lora_base(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="session")
def trained_adapters(lora_base: Path, tmp_path_factory) -> dict[str, Path]:
    """name -> adapter directory, eight SFT adapters trained by `kvik train` (about 3 s each)."""
    work = tmp_path_factory.mktemp("lora-adapters")
    return {f"ad{i}": train_adapter(lora_base, work / f"ad{i}", work, topic=CHAT_TOPICS[i], targets=targets, r=r)
            for i, (r, targets) in enumerate(ADAPTER_SPECS)}
