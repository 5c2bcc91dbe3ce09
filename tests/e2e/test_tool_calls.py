"""Tool calling and reasoning end to end: a real server (the tiny random Llama with SmolLM2's tokenizer and a
Hermes/Qwen-style chat template that renders tools, given by `--chat-template`) started with
`--tool-call-parser qwen25 --reasoning-parser qwen3`, and the real `openai` client.

A random model never calls a tool on its own, so every call here is forced: `tool_choice` "required" or a
named function makes the server constrain the answer with a grammar in the parser's format, and the tests
check what comes back against independent judges: `jsonschema` on each call's arguments, transformers'
own `apply_chat_template` for the prompt the tools and tool turns render to, and the non-streamed answer for
the streamed one (same seed: the assembled deltas must equal it, the name first, two calls as two indices).
Reasoning is forced with a regex (SGLang's `regex` extra) in the shape `<think>...</think>answer`.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.tool_checks import HISTORY, TOOLS, USER, assemble_stream, check_calls, template_messages

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{%- for t in tools %}\n"
    "{{ t | tojson }}{%- endfor %}\n</tools>\nAnswer with <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}\n"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools_template") / "tools.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_runtime_model, template_file):
    """The tiny model keeps its own template; `--chat-template` puts the tool-rendering one in its place."""
    srv = ServerProcess("--model-path", tiny_runtime_model, "--chat-template", template_file,
                        "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3",
                        "--context-length", "2048", "--max-total-tokens", "8192", "--num-threads", "1"
                        ).wait_healthy(timeout=900)
    yield srv
    srv.stop()
    assert "Traceback" not in srv.logs(), srv.logs()


@pytest.fixture(scope="module")
def oai(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_required_always_yields_valid_calls(oai, seed):
    r = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                    temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather", "add"})


def test_named_function_and_single_call(oai):
    r = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=1.0, seed=9, max_tokens=200,
                                    tool_choice={"type": "function", "function": {"name": "add"}},
                                    parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    check_calls(calls, {"add"})
    assert len(calls) == 1


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_streamed_calls_assemble_to_the_non_streamed_answer(oai, seed):
    """OpenAI's stream shape: per call index the first delta carries id, type and name with empty arguments,
    later deltas argument fragments; the assembly and finish_reason equal the whole answer's. Parallel calls
    are allowed, so a random model may call until max_tokens (finish "length", the last call cut short)."""
    kwargs = dict(model="m", messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                  max_tokens=120)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    calls, finish, _, _ = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
    assert finish == whole.finish_reason and finish in ("tool_calls", "length")
    assert len(calls) >= 1 and (finish == "tool_calls" or len(calls) >= 2)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tools_and_tool_turns_render_through_the_template(oai, tiny_runtime_model):
    """The prompt the server built has exactly the tokens transformers' own template rendering gives, with the
    tools and with an assistant call plus a tool result fed back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_runtime_model)
    tok.chat_template = TEMPLATE
    for messages in (USER, HISTORY):
        r = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=1, temperature=0)
        reference = template_messages(messages)
        text = tok.apply_chat_template(reference, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert "get_weather" in text and (messages is USER or "<tool_response>\n5" in text)
        assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def test_reasoning_split_whole_and_streamed(oai):
    regex = r"<think>\n[a-z]{2,6}( [a-z]{2,6}){1,3}\n</think>\n\n[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\."
    kwargs = dict(model="m", messages=USER, temperature=1.0, seed=3, max_tokens=80, extra_body={"regex": regex})
    whole = oai.chat.completions.create(**kwargs).choices[0]
    msg = whole.message
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}\n", msg.reasoning_content), msg
    assert re.fullmatch(r"[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\.", msg.content), msg
    _, _, content, reasoning = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
    assert (reasoning, content) == (msg.reasoning_content, msg.content)


def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(oai):
    import openai

    with pytest.raises(openai.BadRequestError, match="not in `tools`"):
        oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined with json_schema"):
        oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=4,
                                    response_format={"type": "json_object"})
    assert oai.chat.completions.create(model="m", messages=USER, max_tokens=2).choices[0].finish_reason
