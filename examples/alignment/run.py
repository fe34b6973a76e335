"""The alignment demo, end to end, with the `kvik` commands a user would type:

  base model -> SFT -> comparisons (two sampled answers per prompt, labelled by a rule) ->
  agreement report -> filter/split/version -> reward model -> PPO on kvik's engine ->
  `kvik serve` the policy -> win rate against the SFT model, judged by the reward model.

    python examples/alignment/run.py --workdir /tmp/kvik-alignment      (a few minutes on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(command: list[str], cwd: Path) -> None:
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=cwd, check=True)


def kvik(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvik.cli.main", *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_and_evaluate(work: Path, prompts_limit: int) -> None:
    import httpx

    port = free_port()
    command = kvik("serve", "--model", "ppo", "--port", str(port), "--served-model-name", "ppo",
                   "--kv-cache-memory", "128MiB")
    print("$", " ".join(command), "&", flush=True)
    with open(work / "serve.log", "wb") as log:
        server = subprocess.Popen(command, cwd=work, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError((work / "serve.log").read_text())
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        run(kvik("eval", "winrate", "--policy", f"http://127.0.0.1:{port}", "--reference", "sft",
                 "--reward-model", "rm", "--prompts", "prefs", "--limit", str(prompts_limit),
                 "--max-tokens", "16", "--output", "eval"), work)
    finally:
        server.terminate()
        server.wait(timeout=60)


def overrides(quick: bool) -> dict[str, list[str]]:
    if not quick:
        return {"sft": [], "reward": [], "ppo": []}
    return {"sft": ["--max-steps", "120"], "reward": ["--max-steps", "60"], "ppo": ["--max-steps", "6"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer steps (the CI smoke run)")
    parser.add_argument("--fresh", action="store_true", help="delete the work directory first")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    for name in ("sft.yaml", "reward.yaml", "ppo.yaml"):
        shutil.copyfile(HERE / name, work / name)
    steps = overrides(args.quick)
    started = time.monotonic()
    run(kvik("make-model", "base", "--arch", "llama", "--size", "tiny"), work)
    run([sys.executable, str(HERE / "make_data.py"), "--out", "data"], work)
    run(kvik("train", "--config", "sft.yaml", "--no-resume", *steps["sft"]), work)
    # Every prompt, quick or not (seconds either way): 200 left 18 held-out pairs, where one answer
    # more or less moves the reward model's accuracy by 0.06.
    run([sys.executable, str(HERE / "label_by_rule.py"), "--model", "sft", "--prompts",
         "data/prompts.jsonl", "--out", "comparisons.jsonl"], work)
    run(kvik("data", "agreement", "comparisons.jsonl", "--output", "agreement"), work)
    run(kvik("data", "comparisons", "comparisons.jsonl", "--output", "prefs", "--min-agreement", "0.67",
             "--val-fraction", "0.2"), work)
    run(kvik("train", "--config", "reward.yaml", "--no-resume", *steps["reward"]), work)
    run(kvik("train", "--config", "ppo.yaml", "--no-resume", *steps["ppo"]), work)
    serve_and_evaluate(work, prompts_limit=40 if args.quick else 80)
    summary = {
        "agreement": json.loads((work / "agreement" / "agreement.json").read_text())["krippendorff_alpha"],
        "reward_model": json.loads((work / "rm" / "training_summary.json").read_text()).get("val_accuracy"),
        "ppo": json.loads((work / "ppo" / "training_summary.json").read_text()),
        "win_rate": json.loads((work / "eval" / "winrate.json").read_text()),
        "seconds": round(time.monotonic() - started),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
