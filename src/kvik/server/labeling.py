"""`kvik label`'s state: prompts, the two answer sources, and the comparisons file being written.

Answers come from kvik's engine: two model directories (A against B), or one model sampled twice
with different seeds. Items are generated on demand, in prompt order, and shared by every
annotator, so that several people label the same items and their agreement can be measured
(`kvik data agreement`). The answer shown first is chosen by a seeded coin per item: position
bias then cannot favour one model.

The output file is the comparisons JSONL (kvik.core.comparisons), rewritten whole and atomically
after each label; restarting on the same file continues where it stopped, with the same answers.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvik.core.comparisons import Comparison, Label, read_comparisons, write_comparisons
from kvik.core.errors import InvalidRequestError, KvikError, NotFoundError
from kvik.core.sampling_params import SamplingParams


class ConflictError(KvikError):
    """The annotator already labelled this item (HTTP 409)."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "already_labelled"


@dataclass(frozen=True, slots=True)
class AnswerSource:
    name: str  # recorded in the comparison's "models"
    llm: Any  # kvik.LLM
    seed_offset: int


class LabelSession:
    def __init__(self, prompts: list[str], sources: list[AnswerSource], output: Path, *,
                 max_tokens: int = 128, temperature: float = 0.8, seed: int = 0) -> None:
        if len(sources) != 2:
            raise ValueError("two answer sources")
        self.prompts = prompts
        self.sources = sources
        self.output = output
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self._lock = threading.Lock()  # one engine step at a time; one writer of the file
        self.items: list[Comparison] = read_comparisons(output) if output.exists() else []
        self._by_id = {item.id: i for i, item in enumerate(self.items)}

    def _generate(self, prompt_index: int) -> Comparison | None:
        """A new item for prompt `prompt_index`, or None when its two answers are identical."""
        prompt = self.prompts[prompt_index]
        answers = []
        for source in self.sources:
            params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                                    seed=self.seed + 7919 * prompt_index + source.seed_offset)
            llm = source.llm
            if getattr(llm.tokenizer, "chat_template", None):
                output = llm.chat([{"role": "user", "content": prompt}], params)[0]
            else:
                output = llm.generate(prompt, params)[0]
            answers.append(output.outputs[0].text.strip())
        if answers[0] == answers[1] or not all(answers):
            return None
        order = [0, 1]
        random.Random(f"{self.seed}/{prompt_index}").shuffle(order)
        digest = hashlib.sha256("\0".join([prompt, *answers]).encode()).hexdigest()[:10]
        return Comparison(f"p{prompt_index}-{digest}", prompt, tuple(answers[i] for i in order), (),
                          tuple(self.sources[i].name for i in order), {"prompt_index": prompt_index})

    def _ensure_item(self, position: int) -> bool:
        """Make item `position` exist if prompts remain; False when there are no more."""
        done = {item.meta.get("prompt_index") for item in self.items}
        next_prompt = max((i for i in done if isinstance(i, int)), default=-1) + 1
        while len(self.items) <= position and next_prompt < len(self.prompts):
            item = self._generate(next_prompt)
            next_prompt += 1
            if item is not None:
                self._by_id[item.id] = len(self.items)
                self.items.append(item)
                self._save()
        return len(self.items) > position

    def next_item(self, annotator: str) -> dict[str, Any]:
        """The first item `annotator` has not labelled (generated now if need be)."""
        with self._lock:
            position = 0
            while True:
                if not self._ensure_item(position):
                    raise NotFoundError(f"no items left for annotator {annotator!r}: all "
                                        f"{len(self.prompts)} prompts are done", code="no_more_items")
                item = self.items[position]
                if all(label.annotator != annotator for label in item.labels):
                    break
                position += 1
            labelled = sum(any(l.annotator == annotator for l in i.labels) for i in self.items)
            return {"id": item.id, "prompt": item.prompt, "responses": list(item.responses),
                    "labelled": labelled, "prompts": len(self.prompts)}

    def record(self, item_id: str, annotator: str, choice: int) -> dict[str, Any]:
        with self._lock:
            index = self._by_id.get(item_id)
            if index is None:
                raise NotFoundError(f"id: no item {item_id!r}; fetch one from /api/next", code="not_found")
            item = self.items[index]
            if not 0 <= choice < len(item.responses):
                raise InvalidRequestError(f"choice: must be 0 or 1 for item {item_id!r}", param="choice")
            if any(label.annotator == annotator for label in item.labels):
                raise ConflictError(f"annotator {annotator!r} already labelled item {item_id!r}")
            self.items[index] = Comparison(item.id, item.prompt, item.responses,
                                           (*item.labels, Label(annotator, (choice,))),
                                           item.models, item.meta)
            self._save()
            labelled = sum(any(l.annotator == annotator for l in i.labels) for i in self.items)
            return {"ok": True, "labelled": labelled}

    def _save(self) -> None:
        tmp = self.output.with_name(self.output.name + ".tmp")
        write_comparisons(tmp, self.items)
        os.replace(tmp, self.output)
