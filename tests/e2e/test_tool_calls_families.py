"""Tool calling and reasoning on tiny random models that carry their family's own chat template in the
checkpoint (no `--chat-template`): a Qwen3 model with a Qwen3-style template (`--tool-call-parser qwen25
--reasoning-parser qwen3`, overlap scheduling on), a Llama with a Llama-3.1-style template (`llama3`, overlap
off) and one with a Mistral-style template (`mistral`, the `[TOOL_CALLS]name[ARGS]{...}` form).

The templates are short ones written after the real families' tool sections (Qwen3's `<tools>` list and
`<tool_call>` JSON turns, `enable_thinking`; Llama 3.1's JSON function definitions in the first user turn,
`{"name": ..., "parameters": ...}` calls, `ipython` results; Mistral's `[AVAILABLE_TOOLS]` before the last
user turn, `[TOOL_CALLS]`, `[TOOL_RESULTS]`). Judges, per family: the call the grammar forces is the text the
template writes for an assistant call, and the parser reads it back; forced calls ("required", a named
function) validate under `jsonschema`; a streamed answer assembles to the non-streamed one of the same seed;
the prompt the server renders for tools and a tool turn has exactly the tokens of transformers' own
`apply_chat_template` with the checkpoint's template. One server per family, all launched at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.tool_checks import HISTORY, TOOLS, USER, assemble_stream, check_calls, template_messages

# A call's arguments as the real templates write them: a string as given, an object as JSON.
_ARGS = ("{%- if c.function.arguments is string %}{{- c.function.arguments }}"
         "{%- else %}{{- c.function.arguments | tojson }}{%- endif %}")

QWEN3_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' }}{{- t | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{%- if (loop.first and m.content) or not loop.first %}{{- '\\n' }}"
    "{%- endif %}{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}" + _ARGS +
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    # consecutive tool results share one user turn
    "{%- elif m.role == 'tool' %}{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")

LLAMA31_TOOLS_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}"
    "{%- endif %}{{- 'Cutting Knowledge Date: December 2023\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and tools and loop.first %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a "
    "JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in "
    "the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not "
    "use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}{{- m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}" + _ARGS +
    "{{- '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + "
    "'<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

MISTRAL_TOOLS_TEMPLATE = (
    "{{- bos_token }}{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'system' %}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' }}"
    "{%- elif m.role == 'assistant' %}{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{{- '[TOOL_CALLS]' + c.function.name + '[ARGS]' }}" + _ARGS +
    "{%- endfor %}{{- eos_token }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}{%- endif %}"
    "{%- endfor %}")


@dataclass(frozen=True)
class Family:
    template: str
    flags: tuple[str, ...]
    parser: str


FAMILIES = {
    "qwen3": Family(QWEN3_TOOLS_TEMPLATE, ("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3",
                                           "--overlap-schedule", "on"), "qwen25"),
    "llama3": Family(LLAMA31_TOOLS_TEMPLATE, ("--tool-call-parser", "llama3", "--overlap-schedule", "off"),
                     "llama3"),
    "mistral": Family(MISTRAL_TOOLS_TEMPLATE, ("--tool-call-parser", "mistral", "--overlap-schedule", "on"),
                      "mistral"),
}


def _make(name: str, folder: str) -> str:
    """The Qwen3 family's own tiny model for qwen3; the tiny Llama (SmolLM2's tokenizer) for the others."""
    if name == "qwen3":
        from tests.family_models import make_family_model

        make_family_model("qwen3", folder, chat_template=FAMILIES[name].template)
        return folder
    from tests.model_factory import make_tiny_with_smollm2_tokenizer

    return make_tiny_with_smollm2_tokenizer(folder, chat_template=FAMILIES[name].template)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """name -> (checkpoint folder, server), every family's server launched at once (startup is mostly imports
    and waiting: the later ones start while the first is tested); each is checked for tracebacks when the
    module ends."""
    started: dict[str, tuple[str, ServerProcess]] = {}
    try:
        for name, fam in FAMILIES.items():
            folder = _make(name, str(tmp_path_factory.mktemp(f"tools_{name}") / name))
            started[name] = folder, ServerProcess("--model-path", folder, *fam.flags, "--context-length", "1024",
                                                  "--max-total-tokens", "2048", "--num-threads", "1")
        yield started
    finally:
        for _, srv in started.values():
            srv.stop()
    for name, (_, srv) in started.items():
        assert "Traceback" not in srv.logs(), (name, srv.logs())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, servers):
    """(name, checkpoint folder, openai client) of one family's server."""
    import openai

    folder, srv = servers[request.param]
    srv.wait_healthy(timeout=900)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
        yield request.param, folder, client


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_forced_call_is_the_templates_call_and_the_parser_reads_it(name):
    """What the grammar forces for `add(a=2, b=3)` is verbatim what the family's template writes for that
    assistant call (so the model is held to its own format), and the parser reads it back."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tokenloom.function_call.registry import tool_format

    rendered = render_jinja_template([template_messages(HISTORY)], tools=TOOLS, chat_template=FAMILIES[name].template,
                                     bos_token="<s>", eos_token="</s>")[0][0]
    fmt = tool_format(FAMILIES[name].parser, TOOLS)
    forced = fmt.forced_calls()
    names = {"name": '"add"', "raw_name": "add"}
    call = forced.before + forced.begin.format(**names) + '{"a": 2, "b": 3}' + forced.end.format(**names) + \
        forced.after
    assert call in rendered, (call, rendered)
    scan = fmt.scan(call, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == [("add", {"a": 2, "b": 3})]
    assert scan.content.strip() == ""


def test_required_yields_valid_calls(family):
    """tool_choice "required": a valid call (test_tool_calls.py runs more seeds on the Hermes format)."""
    _, _, oai = family
    r = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                    temperature=1.0, seed=1, max_tokens=120, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather", "add"})


def test_named_function_streamed_equals_whole(family):
    """A named function: one valid call of it; the stream (same seed) assembles to the same call, name first,
    finish_reason "tool_calls"."""
    _, _, oai = family
    kwargs = dict(model="m", messages=USER, tools=TOOLS, temperature=1.0, seed=9, max_tokens=120,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    check_calls(whole.message.tool_calls, {"get_weather"})
    assert len(whole.message.tool_calls) == 1 and whole.finish_reason == "tool_calls"
    calls, finish, content, _ = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tools_and_tool_turns_render_through_the_checkpoints_template(family):
    """The server renders tools and a tool-result turn with the checkpoint's own template: its prompt has
    exactly the tokens of transformers' `apply_chat_template` of the same messages."""
    name, folder, oai = family
    tok = _tokenizer(folder)
    for messages in (USER, HISTORY):
        r = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=1, temperature=0)
        text = tok.apply_chat_template(template_messages(messages), tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)
        assert "get_weather" in text and (messages is USER or "5" in text.split("get_weather")[-1])
        assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids), (name, text)


def test_reasoning_split_and_enable_thinking(family):
    """A `<think>...</think>answer` forced by a regex: the Qwen3 server (`--reasoning-parser qwen3`) splits it
    into reasoning_content and content, streamed too, and `enable_thinking: False` renders the template's empty
    think block and the answer is all content; the servers without a reasoning parser keep it all content."""
    name, folder, oai = family
    regex = r"<think>\n[a-z]{2,6}( [a-z]{2,6}){1,3}\n</think>\n\n[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\."
    kwargs = dict(model="m", messages=USER, temperature=1.0, seed=3, max_tokens=60, extra_body={"regex": regex})
    msg = oai.chat.completions.create(**kwargs).choices[0].message
    _, _, content, reasoning = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
    if name != "qwen3":
        assert msg.reasoning_content is None and re.fullmatch(regex, msg.content), msg
        assert (reasoning, content) == ("", msg.content)
        return
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}\n", msg.reasoning_content), msg
    assert re.fullmatch(r"[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\.", msg.content), msg
    assert (reasoning, content) == (msg.reasoning_content, msg.content)

    tok = _tokenizer(folder)
    off = oai.chat.completions.create(model="m", messages=USER, temperature=1.0, seed=3, max_tokens=20,
                                      extra_body={"regex": r"[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\.",
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    for thinking in (False, True):
        text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert text.endswith("<think>\n\n</think>\n\n") != thinking
        if not thinking:
            assert off.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)
    assert off.choices[0].message.reasoning_content is None
    assert re.fullmatch(r"[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\.", off.choices[0].message.content)


def _literal(text: str) -> str:
    """`text` as a regex matching only itself (escapes the grammar backend's regex reads: no `\\ `)."""
    return re.sub(r"([\\.^$*+?()\[\]{}|/])", r"\\\1", text).replace("\n", r"\n")


def test_auto_call_in_the_familys_format_is_parsed(family):
    """tool_choice "auto" (no grammar from the tools): an answer written in the family's own call format, after
    a think block on Qwen3 (reasoning first, as Qwen3 answers), comes back as the call, streamed too."""
    name, _, oai = family
    forced = FAMILIES[name]
    from tokenloom.function_call.registry import tool_format

    calls = tool_format(forced.parser, TOOLS).forced_calls()
    names = {"name": '"add"', "raw_name": "add"}
    text = calls.before + calls.begin.format(**names) + '{"a": 4, "b": -1}' + calls.end.format(**names) + \
        calls.after
    if name == "qwen3":
        text = "<think>\nsum it\n</think>\n\n" + text
    kwargs = dict(model="m", messages=USER, tools=TOOLS, temperature=0, max_tokens=60,
                  extra_body={"regex": _literal(text)})
    whole = oai.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("add", {"a": 4, "b": -1})]
    assert whole.message.content is None
    assert whole.message.reasoning_content == ("sum it\n" if name == "qwen3" else None)
    streamed, finish, content, reasoning = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
    assert (streamed, finish, content) == ([("add", whole.message.tool_calls[0].function.arguments)],
                                           "tool_calls", "")
    assert reasoning == (whole.message.reasoning_content or "")
