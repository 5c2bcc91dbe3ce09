"""The README's structured-output, tool-calling and reasoning examples, run against a server with the real
OpenAI client. Start the server first (the default SmolLM2 model):

    .venv/bin/python -m tokenloom.launch_server --chat-template examples/smollm2_tools.jinja \\
        --tool-call-parser qwen25 --reasoning-parser qwen3
    .venv/bin/python examples/openai_client.py [--base-url http://127.0.0.1:30000/v1]
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


def structured_output(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Give me the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema,
                                                                "strict": True}})
    print("structured:", chat.choices[0].message.content)


def tool_calling(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    chat = client.chat.completions.create(model="smollm2", max_tokens=128, temperature=0, messages=messages,
                                          tools=[WEATHER_TOOL], tool_choice="required")
    choice = chat.choices[0]
    call = choice.message.tool_calls[0]
    print("tool call:", choice.finish_reason, call.function.name, call.function.arguments)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    answer = client.chat.completions.create(model="smollm2", max_tokens=48, temperature=0, messages=messages,
                                            tools=[WEATHER_TOOL])
    print("after the tool result:", answer.choices[0].message.content)


def reasoning(client: OpenAI) -> None:
    # SmolLM2 does not think on its own: a regex (SGLang's extra) holds it to <think>...</think>answer, and
    # --reasoning-parser qwen3 splits the two parts, streamed or not.
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=256, temperature=0,
        messages=[{"role": "user", "content": "Is 17 a prime number? Think first."}],
        extra_body={"regex": r"<think>[A-Za-z0-9 ,.']{10,400}[.]</think>[A-Za-z0-9 ,.']{1,160}[.]"})
    message = chat.choices[0].message
    print("reasoning:", message.reasoning_content)
    print("answer:", message.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    client = OpenAI(base_url=parser.parse_args().base_url, api_key="none")
    structured_output(client)
    tool_calling(client)
    reasoning(client)


if __name__ == "__main__":
    main()
