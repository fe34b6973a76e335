"""Tiny random models dressed as tool-calling and reasoning models: a copy of a kvik-written model with
a chat template in the style of a model family, and (for thinking) `<think>`/`</think>` added to the
vocabulary. The templates are written here, in the shape of the families' own, so the server must
find the format from the template as it would for the real models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Qwen3-style: tools described in the system turn, calls as <tool_call> JSON (Hermes), tool results
# in a user turn, and thinking that `enable_thinking: false` closes in the prompt. `open_thinking`
# (this test's own switch) opens it in the prompt, as DeepSeek-R1's template does.
HERMES_THINKING_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures, inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one with a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif not (message.role == 'system' and loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif open_thinking is defined and open_thinking %}<think>
{% endif %}
{%- endif %}"""

# Llama 3.1-style: JSON calls with "parameters", tool results under the ipython role.
LLAMA3_TEMPLATE = """\
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
To call a function, answer with only a JSON object {"name": function name, "parameters": arguments}.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

THINK_TOKENS = ("<think>", "</think>")


def dress_model(source: Path, out: Path, template: str, added_tokens: tuple[str, ...] = ()) -> Path:
    """Copy the model at `source` to `out` with `template` as its chat template and `added_tokens`
    appended to its vocabulary (the model's embedding rows must have room: Qwen-style padding)."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(source, out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    if added_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
        tokenizer.save(str(out / "tokenizer.json"))
        for text in added_tokens:
            config["added_tokens_decoder"][str(tokenizer.token_to_id(text))] = {
                "content": text, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": False}
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
