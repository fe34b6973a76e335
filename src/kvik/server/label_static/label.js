"use strict";
// kvik label: fetch an item, show the prompt and its two answers, post the annotator's choice.
// Model text is only ever written with textContent (never as HTML).
(function () {
  let annotator = "";
  let current = null;
  let busy = false;
  const $ = (id) => document.getElementById(id);

  function say(text) { $("message").textContent = text; }

  async function api(path, options) {
    const response = await fetch(path, options);
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      const error = (body && body.error) || {};
      const failure = new Error(error.message || ("HTTP " + response.status));
      failure.code = error.code;
      throw failure;
    }
    return body;
  }

  async function next() {
    busy = true;
    say("Generating the next answers…");
    try {
      current = await api("/api/next?annotator=" + encodeURIComponent(annotator));
      $("prompt").textContent = current.prompt;
      current.responses.forEach((text, i) => {
        $("answer-" + i).querySelector("pre").textContent = text;
      });
      $("progress").textContent = annotator + ": " + current.labelled + " labelled of " + current.prompts + " prompts";
      $("task").hidden = false;
      say("");
    } catch (error) {
      $("task").hidden = true;
      current = null;
      say(error.code === "no_more_items" ? "All done, thank you." : error.message);
    } finally {
      busy = false;
    }
  }

  async function choose(choice) {
    if (!current || busy) return;
    busy = true;
    try {
      await api("/api/label", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ id: current.id, annotator: annotator, choice: choice }),
      });
    } catch (error) {
      say(error.message);
    } finally {
      busy = false;
    }
    await next();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("who").addEventListener("submit", (event) => {
      event.preventDefault();
      annotator = $("annotator").value.trim();
      if (annotator) next();
    });
    document.querySelectorAll(".answer").forEach((button) => {
      button.addEventListener("click", () => choose(Number(button.dataset.choice)));
    });
    document.addEventListener("keydown", (event) => {
      if (event.target instanceof HTMLInputElement) return;
      if (event.key === "1" || event.key === "2") choose(Number(event.key) - 1);
    });
  });
})();
