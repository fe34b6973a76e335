"""kvik against llama.cpp on the same GGUF file, one precision pair at a time, printed as ratios.

A pair names the GGUF llama.cpp runs and the engine arguments kvik runs it with (kvik reads the same
file, dequantizes it at load, then applies its own precision flags):

    {"name": "bf16 vs f16", "gguf": "f16", "kvik": {"dtype": "bfloat16"}}

`PAIRS` holds the pairs issue 12 asks for; `--pairs` picks by name and `--pairs-file` (a JSON list in
that shape) replaces them, so new kvik flags need no code change here. Every ratio reads "> 1: kvik
ahead": kvik / llama.cpp for throughputs, llama.cpp / kvik for latencies. The two engines run one
after the other on each workload, so the noise of a shared machine hits both sides alike, and which
goes first alternates from round to round. For the served latencies both servers are up at once and
each concurrency runs on one right after the other (the first alternating by concurrency too).

With `rounds` > 1 every pair runs that many times (round after round over all pairs, so a slow drift
of the machine's load spreads over them) and each measure reports the median of its per-round ratios
with their range: on a noisy machine one round's TPOT moves 10-20 %, enough to cross a target.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvik.bench.llamacpp import measure
from kvik.bench.llamacpp.ggufs import gguf_file

# The KV cache: llama.cpp keeps it in float16 unless told otherwise, so every pair but f32 has kvik's
# in 16 bits too (bfloat16: 2 bytes a value, as f16). kvik's default would follow the weights' compute
# dtype, float32 for int8/int4, and read twice llama.cpp's KV bytes a step.
PAIRS: list[dict[str, Any]] = [
    {"name": "f32 vs f32", "gguf": "f32", "kvik": {"dtype": "float32"}},
    {"name": "bf16 vs f16", "gguf": "f16", "kvik": {"dtype": "bfloat16"}},
    {"name": "int8 vs q8_0", "gguf": "q8_0", "kvik": {"quantization": "int8", "kv_cache_dtype": "bfloat16"}},
    # int8's default is Q8_0's own layout (a scale per 32 inputs: kvik holds the file's weights
    # exactly); this is int8 with a scale per output channel instead.
    {"name": "int8-channel vs q8_0", "gguf": "q8_0",
     "kvik": {"quantization": "int8", "quantization_group_size": 0, "kv_cache_dtype": "bfloat16"}},
    {"name": "int4 vs q4_0", "gguf": "q4_0", "kvik": {"quantization": "int4", "kv_cache_dtype": "bfloat16"}},
    {"name": "int4 vs q4_k_m", "gguf": "q4_k_m", "kvik": {"quantization": "int4", "kv_cache_dtype": "bfloat16"}},
]
# Issue 12's pairs: each kvik precision against llama.cpp's format of about the same bytes per weight.
DEFAULT_PAIRS = ("bf16 vs f16", "int8 vs q8_0", "int4 vs q4_0")


@dataclass(slots=True)
class HarnessConfig:
    llamacpp_dir: Path
    models: dict[str, Path]  # label -> HF model directory or .gguf file
    out_dir: Path
    pairs: list[dict[str, Any]] = field(default_factory=lambda: [p for p in PAIRS
                                                                 if p["name"] in DEFAULT_PAIRS])
    threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    rounds: int = 1
    kv_cache_memory: str = "2GiB"
    offline: measure.OfflineSpec = field(default_factory=measure.OfflineSpec)
    served: measure.ServedSpec = field(default_factory=measure.ServedSpec)


def select_pairs(names: str | None, pairs_file: str | None) -> list[dict[str, Any]]:
    pairs = json.loads(Path(pairs_file).read_text()) if pairs_file else PAIRS
    wanted = [n.strip() for n in (names or ",".join(DEFAULT_PAIRS)).split(",") if n.strip()]
    if pairs_file and not names:
        return pairs
    known = {p["name"]: p for p in pairs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown pair(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in wanted]


def run_pair(config: HarnessConfig, label: str, model: Path, pair: dict[str, Any],
             round_index: int = 0) -> dict[str, Any]:
    gguf = gguf_file(config.llamacpp_dir, model, pair["gguf"], config.out_dir / "gguf")
    engine_args = {"kv_cache_memory": config.kv_cache_memory, **pair["kvik"]}
    slug = "".join(c if c.isalnum() else "-" for c in pair["name"])
    work = config.out_dir / f"{label}-{slug}" / f"round-{round_index + 1}"
    work.mkdir(parents=True, exist_ok=True)
    print(f"\n== {label}: {pair['name']} on {gguf.name}, round {round_index + 1} of {config.rounds}", flush=True)
    # Which engine goes first on each workload alternates from round to round. On the shared 2-core
    # machine the order moves a ratio: in the first run that alternated (4 rounds, both models, six
    # pairs) kvik's ratios were ~4 % lower, by the median of the measures, in the rounds it went
    # first; the fixed order before (llama.cpp first) put that on kvik's side.
    llama_first = round_index % 2 == 0

    def in_turn(llama_side: Callable[[], Any], kvik_side: Callable[[], Any]) -> tuple[Any, Any]:
        """(llama.cpp's result, kvik's), measured in this round's order."""
        if llama_first:
            llama = llama_side()
            return llama, kvik_side()
        kvik = kvik_side()
        return llama_side(), kvik

    llama_single, kvik = in_turn(
        lambda: measure.llamacpp_single_stream(config.llamacpp_dir, gguf, config.threads),
        lambda: measure.kvik_engine(gguf, engine_args, config.offline, work / "kvik-engine.json"))
    # Both servers stay up for the served workloads, and each concurrency runs on one right after
    # the other, the first server alternating by concurrency as well as by round.
    llama_http, kvik_http = measure.served_side_by_side(
        config.llamacpp_dir, gguf, config.threads, engine_args, config.offline, config.served, work,
        llama_first=lambda index: (round_index + index) % 2 == 0)
    result = {"model": label, "pair": pair, "gguf": str(gguf),
              "kvik": {**kvik, **kvik_http}, "llamacpp": {**llama_single, **llama_http}}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    return result


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One pair's rounds as one result: a single round as it is, several under "rounds" (ratio_rows
    reads their medians)."""
    if len(rounds) == 1:
        return rounds[0]
    first = rounds[0]
    return {"model": first["model"], "pair": first["pair"], "gguf": first["gguf"],
            "rounds": [{"kvik": r["kvik"], "llamacpp": r["llamacpp"]} for r in rounds]}


def _round_rows(kvik: dict[str, Any], llama: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    rows = [("decode tg128, tok/s", kvik["decode_tokens_per_second"], llama["decode_tokens_per_second"]),
            ("prompt pp512, tok/s", kvik["prompt_tokens_per_second"], llama["prompt_tokens_per_second"]),
            ("offline 32 req, total tok/s", kvik["offline"]["tokens_per_second"],
             llama["offline"]["tokens_per_second"])]
    table = [(name, ours, theirs, ours / theirs) for name, ours, theirs in rows]
    for concurrency, ours in kvik["served"].items():
        theirs = llama["served"][concurrency]
        for key, name in (("p50_ttft_ms", "TTFT p50, ms"), ("p99_ttft_ms", "TTFT p99, ms"),
                          ("p50_tpot_ms", "TPOT p50, ms")):
            table.append((f"served c={concurrency} {name}", ours[key], theirs[key], theirs[key] / ours[key]))
    return table


def num_rounds(result: dict[str, Any]) -> int:
    return len(result.get("rounds") or [result])


def round_tables(result: dict[str, Any]) -> list[list[tuple[str, float, float, float]]]:
    rounds = result.get("rounds") or [result]
    return [_round_rows(r["kvik"], r["llamacpp"]) for r in rounds]


def ratio_rows(result: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(measure, kvik, llama.cpp, ratio with > 1 meaning kvik ahead); over several rounds each is
    the median, the ratio the median of the per-round ratios (pair by pair, not of the medians)."""
    tables = round_tables(result)
    return [(rows[0][0], *(statistics.median(row[i] for row in rows) for i in (1, 2, 3)))
            for rows in zip(*tables)]


def ratio_ranges(result: dict[str, Any]) -> list[tuple[float, float]]:
    """Each measure's lowest and highest per-round ratio."""
    return [(min(row[3] for row in rows), max(row[3] for row in rows)) for rows in zip(*round_tables(result))]


def format_result(result: dict[str, Any]) -> list[str]:
    rounds = num_rounds(result)
    many = rounds > 1
    lines = [f"\n{result['model']}: kvik {json.dumps(result['pair']['kvik'])} vs llama.cpp "
             f"{result['pair']['gguf']}, same file {Path(result['gguf']).name}"
             + (f", medians of {rounds} rounds" if many else ""),
             f"  {'':<34}{'kvik':>10}{'llama.cpp':>12}{'ratio':>9}" + (f"{'range':>15}" if many else "")
             + "   (ratio > 1: kvik ahead)"]
    for (name, ours, theirs, ratio), (low, high) in zip(ratio_rows(result), ratio_ranges(result)):
        lines.append(f"  {name:<34}{ours:10.1f}{theirs:12.1f}{ratio:8.2f}x"
                     + (f"   {low:5.2f}-{high:.2f}x" if many else ""))
    return lines


def target(measure: str) -> float:
    """Issue 12's bar for a measure: 1.1x single-stream (decode, 512-token prompt), 1.5x offline and
    served."""
    return 1.1 if measure.startswith(("decode", "prompt")) else 1.5


def plot_ratios(results: list[dict[str, Any]], out: Path) -> Path:
    """One panel per model: each measure's kvik / llama.cpp ratio (> 1: kvik ahead) per precision pair,
    on a log axis with 1.0 and the issue's targets drawn, so the rows that miss stand out; over
    several rounds, the median with the rounds' range as a whisker."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    models = list(dict.fromkeys(r["model"] for r in results))
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 6.5), squeeze=False,
                                constrained_layout=True)
    for axis, model in zip(axes[0], models):
        chosen = [r for r in results if r["model"] == model]
        measures = [name for name, *_ in ratio_rows(chosen[0])]
        height = 0.8 / len(chosen)
        for index, result in enumerate(chosen):
            ratios = [ratio for *_, ratio in ratio_rows(result)]
            positions = [row + index * height for row in range(len(measures))]
            # Over several rounds the bar is the median ratio and the whisker its range.
            spread = None
            if num_rounds(result) > 1:
                ranges = ratio_ranges(result)
                spread = [[r - low for r, (low, _) in zip(ratios, ranges)],
                          [high - r for r, (_, high) in zip(ratios, ranges)]]
            axis.barh(positions, ratios, height=height, xerr=spread, capsize=2, label=result["pair"]["name"])
        for row, measure in enumerate(measures):
            axis.plot([target(measure)] * 2, [row - height / 2, row + 0.8 - height / 2], color="black",
                      linestyle=":", linewidth=1)
        axis.axvline(1.0, color="black", linewidth=1)
        axis.set_xscale("log")
        axis.xaxis.set_major_locator(FixedLocator([0.5, 0.75, 1, 1.1, 1.5, 2, 3, 4]))
        axis.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_yticks([row + 0.4 - height / 2 for row in range(len(measures))], measures)
        axis.invert_yaxis()
        axis.set_xlabel("kvik / llama.cpp (> 1: kvik ahead; dotted: the issue's target)")
        axis.set_title(f"{model}, same GGUF file for both engines")
        # Below the axis: inside, it covered the bottom rows.
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    figure.savefig(out)
    plt.close(figure)
    return out


def run_harness(config: HarnessConfig) -> dict[str, Any]:
    config.out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(label, model, pair) for label, model in config.models.items() for pair in config.pairs]
    rounds: list[list[dict[str, Any]]] = [[] for _ in jobs]
    for round_index in range(config.rounds):
        for job, (label, model, pair) in zip(rounds, jobs):
            job.append(run_pair(config, label, model, pair, round_index))
    results = [combine_rounds(job) for job in rounds]
    lines = [line for result in results for line in format_result(result)]
    print("\n".join(lines), flush=True)
    report = {"config": {**asdict(config), "llamacpp_dir": str(config.llamacpp_dir),
                         "out_dir": str(config.out_dir),
                         "models": {k: str(v) for k, v in config.models.items()}},
              "results": results, "printed": lines}
    (config.out_dir / "llamacpp.json").write_text(json.dumps(report, indent=1, default=str))
    try:
        print(f"ratios plotted in {plot_ratios(results, config.out_dir / 'llamacpp.svg')}")
    except ImportError:  # matplotlib comes with kvik[train]; the figures are in the JSON regardless
        print("no plot: matplotlib is not installed (pip install 'kvik[train]')")
    return report

