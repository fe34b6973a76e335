"""The llama.cpp comparison's pure parts (the runs themselves need a llama.cpp build and are not in CI):
pair selection, kvik flags from engine arguments, and ratios that read "> 1: kvik ahead"."""

from __future__ import annotations

import json

import pytest

from kvik.bench.llamacpp.harness import PAIRS, format_result, ratio_rows, select_pairs
from kvik.bench.llamacpp.measure import engine_flags


def test_engine_arguments_become_kvik_serve_flags():
    assert engine_flags({"dtype": "bfloat16", "kv_cache_memory": "2GiB", "enforce_eager": True,
                         "quantization": None}) == [
        "--dtype", "bfloat16", "--kv-cache-memory", "2GiB", "--enforce-eager"]


def test_pairs_are_chosen_by_name_or_read_from_a_file(tmp_path):
    assert [p["name"] for p in select_pairs(None, None)] == ["bf16 vs f16", "int8 vs q8_0", "int4 vs q4_0"]
    assert select_pairs("bf16 vs f16, int8 vs q8_0", None) == [PAIRS[1], PAIRS[2]]
    with pytest.raises(ValueError, match="unknown pair"):
        select_pairs("fp8 vs q8_0", None)
    own = [{"name": "mine", "gguf": "q4_k_m", "kvik": {"quantization": "int4", "group_size": 64}}]
    (tmp_path / "pairs.json").write_text(json.dumps(own))
    assert select_pairs(None, str(tmp_path / "pairs.json")) == own


def test_every_ratio_reads_greater_than_one_when_kvik_is_ahead():
    served = {"1": {"p50_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "p50_tpot_ms": 10.0}}
    slower = {"1": {"p50_ttft_ms": 100.0, "p99_ttft_ms": 400.0, "p50_tpot_ms": 20.0}}
    result = {"model": "reference", "pair": PAIRS[0], "gguf": "/x/ref-f32.gguf",
              "kvik": {"decode_tokens_per_second": 90.0, "prompt_tokens_per_second": 1500.0,
                       "offline": {"tokens_per_second": 1000.0}, "served": served},
              "llamacpp": {"decode_tokens_per_second": 60.0, "prompt_tokens_per_second": 1000.0,
                           "offline": {"tokens_per_second": 500.0}, "served": slower}}
    ratios = {name: ratio for name, _, _, ratio in ratio_rows(result)}
    assert ratios == {"decode tg128, tok/s": 1.5, "prompt pp512, tok/s": 1.5,
                      "offline 32 req, total tok/s": 2.0, "served c=1 TTFT p50, ms": 2.0,
                      "served c=1 TTFT p99, ms": 5.0, "served c=1 TPOT p50, ms": 2.0}
    printed = "\n".join(format_result(result))
    assert "ref-f32.gguf" in printed and "1.50x" in printed


def test_ratios_are_plotted_per_model(tmp_path):
    """The run ends with a plot of every ratio per model and pair (the figures people look at)."""
    pytest.importorskip("matplotlib")
    from kvik.bench.llamacpp.harness import plot_ratios, target

    served = {"1": {"p50_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "p50_tpot_ms": 10.0}}
    results = [{"model": model, "pair": pair, "gguf": f"/x/{model}.gguf",
                "kvik": {"decode_tokens_per_second": 90.0, "prompt_tokens_per_second": 1500.0,
                         "offline": {"tokens_per_second": 1000.0}, "served": served},
                "llamacpp": {"decode_tokens_per_second": 60.0, "prompt_tokens_per_second": 1000.0,
                             "offline": {"tokens_per_second": 500.0}, "served": served}}
               for model in ("reference", "smollm2") for pair in PAIRS[:2]]
    out = plot_ratios(results, tmp_path / "ratios.svg")
    text = out.read_text()
    assert text.startswith("<?xml") and "reference, same GGUF file" in text and "smollm2" in text
    assert target("decode tg128, tok/s") == 1.1 and target("served c=1 TTFT p50, ms") == 1.5


def one_round(decode: float, llama_decode: float, tpot: float, llama_tpot: float) -> dict:
    return {"kvik": {"decode_tokens_per_second": decode, "prompt_tokens_per_second": 1000.0,
                     "offline": {"tokens_per_second": 1000.0},
                     "served": {"1": {"p50_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "p50_tpot_ms": tpot}}},
            "llamacpp": {"decode_tokens_per_second": llama_decode, "prompt_tokens_per_second": 1000.0,
                         "offline": {"tokens_per_second": 500.0},
                         "served": {"1": {"p50_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "p50_tpot_ms": llama_tpot}}}}


def test_several_rounds_report_the_median_of_the_per_round_ratios_and_their_range():
    from kvik.bench.llamacpp.harness import combine_rounds, ratio_ranges

    # Round 2 ran on a busier machine for both engines: its figures are low but its ratio is not.
    rounds = [one_round(100.0, 50.0, 10.0, 14.0), one_round(60.0, 40.0, 20.0, 36.0),
              one_round(90.0, 60.0, 11.0, 16.5)]
    result = combine_rounds([{"model": "reference", "pair": PAIRS[1], "gguf": "/x/ref-f16.gguf", **r}
                             for r in rounds])
    assert "kvik" not in result and len(result["rounds"]) == 3
    rows = {name: (ours, theirs, ratio) for name, ours, theirs, ratio in ratio_rows(result)}
    # Ratios per round 2.0 / 1.5 / 1.5: the median is 1.5, not the ratio of the medians (90 / 50).
    assert rows["decode tg128, tok/s"] == (90.0, 50.0, 1.5)
    assert rows["served c=1 TPOT p50, ms"] == (11.0, 16.5, 1.5)
    ranges = dict(zip(rows, ratio_ranges(result)))
    assert ranges["decode tg128, tok/s"] == (1.5, 2.0) and ranges["served c=1 TPOT p50, ms"] == (1.4, 1.8)
    printed = "\n".join(format_result(result))
    assert "medians of 3 rounds" in printed and "1.40-1.80x" in printed
    # A single round reads as before, without a range column.
    single = combine_rounds([{"model": "reference", "pair": PAIRS[1], "gguf": "/x/ref-f16.gguf", **rounds[0]}])
    assert single["kvik"] == rounds[0]["kvik"] and "range" not in "\n".join(format_result(single))


def test_rounds_run_round_after_round_over_every_pair(tmp_path, monkeypatch):
    from kvik.bench.llamacpp import harness

    order = []

    def fake_run_pair(config, label, model, pair, round_index=0):
        order.append((round_index, label, pair["name"]))
        return {"model": label, "pair": pair, "gguf": f"/x/{label}.gguf", **one_round(90.0, 60.0, 10.0, 15.0)}

    monkeypatch.setattr(harness, "run_pair", fake_run_pair)
    monkeypatch.setattr(harness, "plot_ratios", lambda results, out: out)
    config = harness.HarnessConfig(llamacpp_dir=tmp_path, models={"a": tmp_path, "b": tmp_path},
                                   out_dir=tmp_path / "out", pairs=PAIRS[1:3], rounds=2)
    report = harness.run_harness(config)
    assert order == [(r, m, p["name"]) for r in (0, 1) for m in ("a", "b") for p in PAIRS[1:3]]
    assert [len(result["rounds"]) for result in report["results"]] == [2] * 4
    assert json.loads((tmp_path / "out" / "llamacpp.json").read_text())["config"]["rounds"] == 2


def test_which_engine_runs_first_alternates_by_round(tmp_path, monkeypatch):
    """Each workload runs both engines back to back; the one that goes first swaps every round, so
    an order effect of the machine does not land on one side. The results keep their sides."""
    from kvik.bench.llamacpp import harness, measure

    calls = []

    def recorder(name, value):
        def call(*args, **kwargs):
            calls.append(name)
            return value
        return call

    def served(*args, llama_first):
        calls.append("served, llama.cpp first at " + ",".join(str(i) for i in range(3) if llama_first(i)))
        return {"served": 3}, {"served": 4}

    monkeypatch.setattr(harness, "gguf_file", lambda *args: tmp_path / "m.gguf")
    monkeypatch.setattr(measure, "llamacpp_single_stream", recorder("llama single", {"decode": 1}))
    monkeypatch.setattr(measure, "kvik_engine", recorder("kvik engine", {"decode": 2}))
    monkeypatch.setattr(measure, "served_side_by_side", served)
    config = harness.HarnessConfig(llamacpp_dir=tmp_path, models={"a": tmp_path}, out_dir=tmp_path / "out",
                                   pairs=PAIRS[1:2], rounds=2)
    results = [harness.run_pair(config, "a", tmp_path, PAIRS[1], round_index) for round_index in (0, 1, 2)]
    assert calls == ["llama single", "kvik engine", "served, llama.cpp first at 0,2",
                     "kvik engine", "llama single", "served, llama.cpp first at 1",
                     "llama single", "kvik engine", "served, llama.cpp first at 0,2"]
    for result in results:
        assert result["llamacpp"] == {"decode": 1, "served": 3} and result["kvik"] == {"decode": 2, "served": 4}


def test_served_latencies_pair_each_concurrency_with_both_servers_up(tmp_path, monkeypatch):
    """Both servers start before anything is measured; llama-server's offline workload runs first,
    then each concurrency on both servers back to back, in the order `llama_first` gives."""
    from contextlib import contextmanager

    from kvik.bench.llamacpp import measure

    events = []

    @contextmanager
    def server(command, port, log_path):
        name = "kvik" if "kvik.cli.main" in command else "llama"
        events.append(f"start {name}")
        yield f"http://{name}"
        events.append(f"stop {name}")

    def served_at(url, spec, vocab, concurrency):
        events.append(f"{url[7:]} c={concurrency}")
        return {"p50_tpot_ms": 1.0 if url.endswith("kvik") else 2.0}

    monkeypatch.setattr(measure, "model_vocab_size", lambda path: 100)
    monkeypatch.setattr(measure, "llamacpp_bin", lambda directory, tool: directory / tool)
    monkeypatch.setattr(measure, "running_server", server)
    monkeypatch.setattr(measure, "http_offline", lambda url, spec, vocab: events.append(f"{url[7:]} offline") or {})
    monkeypatch.setattr(measure, "served_at", served_at)
    llama, kvik = measure.served_side_by_side(
        tmp_path, tmp_path / "m.gguf", 2, {"quantization": "int8"}, measure.OfflineSpec(), measure.ServedSpec(),
        tmp_path, llama_first=lambda index: index % 2 == 1)
    assert events == ["start llama", "start kvik", "llama offline", "kvik c=1", "llama c=1",
                      "llama c=4", "kvik c=4", "kvik c=16", "llama c=16", "stop kvik", "stop llama"]
    assert llama["served"]["4"] == {"p50_tpot_ms": 2.0} and kvik["served"]["4"] == {"p50_tpot_ms": 1.0}
    assert set(llama) == {"offline", "served"} and set(kvik) == {"served"}


def test_a_plot_of_several_rounds_draws_each_median_with_its_range(tmp_path):
    pytest.importorskip("matplotlib")
    from kvik.bench.llamacpp.harness import combine_rounds, plot_ratios

    rounds = [one_round(100.0, 50.0, 10.0, 14.0), one_round(60.0, 40.0, 20.0, 36.0)]

    def drawn(rounds_per_pair: list[dict], name: str) -> str:
        results = [combine_rounds([{"model": "reference", "pair": pair, "gguf": "/x/ref.gguf", **r}
                                   for r in rounds_per_pair]) for pair in PAIRS[:2]]
        return plot_ratios(results, tmp_path / name).read_text()

    single, several = drawn(rounds[:1], "one.svg"), drawn(rounds, "two.svg")
    # The same bars, plus a whisker with two caps per bar (6 measures x 2 pairs).
    assert several.count("<path") >= single.count("<path") + 12


@pytest.mark.parametrize("rounds", ["0", "-2", "three"])
def test_a_round_count_below_one_or_not_a_number_is_refused_before_anything_runs(rounds, capsys):
    from kvik.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "compare", "--llamacpp-dir", "/nonexistent", "--llamacpp-rounds", rounds])
    assert exit_info.value.code == 2
    assert "--llamacpp-rounds" in capsys.readouterr().err
