"""`kvik label` as a real process over HTTP: the page and its assets carry a strict CSP and no
inline script; two annotators label the same items; the file written is valid comparisons JSONL
that `kvik data agreement` reads; bad input gets 4xx in OpenAI's error shape; a restart continues
the same items."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tests.server.conftest import free_port

from kvik.core.comparisons import read_comparisons


def _start(model: Path, prompts: Path, output: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "kvik.cli.main", "label", "--model", str(model), "--prompts",
               str(prompts), "--output", str(output), "--port", str(port), "--max-tokens", "12",
               "--device", "cpu"]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(log.read_text())
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"kvik label not ready:\n{log.read_text()}")


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def test_label_page_records_choices_of_two_annotators(tiny_llama: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about item {i}."}) + "\n" for i in range(3)))
    output = tmp_path / "comparisons.jsonl"
    process, url = _start(tiny_llama, prompts, output, tmp_path / "label.log")
    try:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert "frame-ancestors 'none'" in csp
        html = page.text
        assert re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html) is None  # no inline script
        assert re.search(r"\son[a-z]+\s*=", html, re.IGNORECASE) is None  # no onclick= handlers
        assert "http://" not in html and "https://" not in html  # nothing from a CDN
        for asset in ("/static/label.js", "/static/label.css"):
            response = httpx.get(url + asset)
            assert response.status_code == 200 and response.headers["content-security-policy"] == csp
        assert "innerHTML" not in httpx.get(url + "/static/label.js").text

        seen = []
        for annotator, choices in (("alice", [0, 1, 0]), ("bob", [0, 0, 1])):
            for choice in choices:
                item = httpx.get(url + "/api/next", params={"annotator": annotator}, timeout=60).json()
                assert len(item["responses"]) == 2 and item["responses"][0] != item["responses"][1]
                seen.append(item["id"])
                recorded = httpx.post(url + "/api/label", json={"id": item["id"], "annotator": annotator,
                                                               "choice": choice})
                assert recorded.status_code == 200 and recorded.json()["ok"] is True
            done = httpx.get(url + "/api/next", params={"annotator": annotator}, timeout=60)
            _assert_error(done, 404)
            assert done.json()["error"]["code"] == "no_more_items"
        assert seen[:3] == seen[3:]  # both annotators labelled the same items

        item_id = seen[0]
        _assert_error(httpx.post(url + "/api/label", json={"id": item_id, "annotator": "alice",
                                                           "choice": 1}), 409)
        _assert_error(httpx.post(url + "/api/label", json={"id": item_id, "annotator": "carol",
                                                           "choice": 2}), 400, "choice")
        _assert_error(httpx.post(url + "/api/label", json={"id": item_id, "annotator": "carol",
                                                           "choice": "0"}), 400, "choice")
        _assert_error(httpx.post(url + "/api/label", json={"id": "nope", "annotator": "carol",
                                                           "choice": 0}), 404)
        _assert_error(httpx.post(url + "/api/label", json={"id": item_id, "annotator": "<script>",
                                                           "choice": 0}), 400, "annotator")
        _assert_error(httpx.post(url + "/api/label", json={"id": item_id, "annotator": "carol",
                                                           "choice": 0, "extra": 1}), 400)
        _assert_error(httpx.post(url + "/api/label", content=b"{not json",
                                 headers={"content-type": "application/json"}), 400)
        _assert_error(httpx.get(url + "/api/next", params={"annotator": ""}), 400, "annotator")
        _assert_error(httpx.get(url + "/static/../labeling.py"), 404)
    finally:
        _stop(process)

    items = read_comparisons(output)
    assert [item.id for item in items] == seen[:3]
    assert [[(label.annotator, label.choice) for label in item.labels] for item in items] == [
        [("alice", 0), ("bob", 0)], [("alice", 1), ("bob", 0)], [("alice", 0), ("bob", 1)]]
    agreement = subprocess.run([sys.executable, "-m", "kvik.cli.main", "data", "agreement", str(output)],
                               capture_output=True, text=True, timeout=120)
    assert agreement.returncode == 0 and "alice / bob" in agreement.stdout

    # A restart on the same file continues: the same items, carol starts at the first.
    process, url = _start(tiny_llama, prompts, output, tmp_path / "label2.log")
    try:
        item = httpx.get(url + "/api/next", params={"annotator": "carol"}, timeout=60).json()
        assert item["id"] == seen[0]
        _assert_error(httpx.get(url + "/api/next", params={"annotator": "alice"}, timeout=60), 404)
    finally:
        _stop(process)
