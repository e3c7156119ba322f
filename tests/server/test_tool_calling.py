"""Tool calling and reasoning through the OpenAI API, with the official `openai` client against a
real server (uvicorn, the engine, the tiny random checkpoint) serving the Qwen3 chat template.

A random tiny model never writes a tool call by itself, so the test steers its output with a
test double of the model output only: `ScriptedSampler` (tests/scripted_output.py) replaces
the sampling function the speculator calls, so each sampled token is the next token of a
script. Everything else is real — prefill and decode forwards, the engine loop,
detokenization, the chat template, the parsers, SSE. Rendered prompts are checked against `transformers`' `apply_chat_template`.
"""

import json
from pathlib import Path

import openai
import pytest
from scripted_output import WEATHER, ScriptedSampler, record_prompts, reply_parts, streamed_calls, ws_generation
from websockets.sync.client import connect

import pdflash.spec.speculator
from pdflash.chat.families import PLAIN
from pdflash.chat.template import ChatTemplate
from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app
from pdflash.server.chat import ChatSetup, prepare_turn
from pdflash.server.chat_request import parse_chat_request
from pdflash.server.errors import APIError

TEMPLATE = Path(__file__).parents[1] / "chat" / "fixtures" / "qwen3_chat_template.jinja"
MODEL = "tiny"
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
THINK_THEN_CALL = (
    "<think>\nThe user wants the weather; call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": "°C"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def served(tiny_target):
    """(server, sampler, prompts the engine was asked to continue)."""
    engine = AsyncEngine.from_pretrained(tiny_target, None, max_num_seqs=2)
    prompts = record_prompts(engine)
    sampler = ScriptedSampler(engine.tokenizer)
    settings = ServerSettings(model_name=MODEL, default_max_tokens=200, chat_template=TEMPLATE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pdflash.spec.speculator, "sample", sampler)
        with BackgroundServer(create_app(engine, settings)) as server:
            yield server, sampler, prompts


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def transformers_tokenizer(tiny_target):
    """The oracle: transformers' tokenizer for the tiny checkpoint, with the served template."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((tiny_target / "tokenizer_config.json").read_text())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_target / "tokenizer.json"), eos_token=config["eos_token"])
    hf.chat_template = TEMPLATE.read_text()
    return hf


def expected_prompt(hf, messages, tools=None, **kwargs):
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)


def test_a_tool_call_comes_back_parsed_whole_and_streamed(served, client, transformers_tokenizer):
    _, sampler, prompts = served
    sampler.say(THINK_THEN_CALL)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
    assert prompts[-1] == expected_prompt(transformers_tokenizer, QUESTION, [WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather; call the tool."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "units": "°C"}

    sampler.say(THINK_THEN_CALL)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], stream=True))
    (streamed,) = streamed_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments)
    assert streamed["pieces"] > 3  # arguments arrived incrementally, not in one piece
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert reasoning == choice.message.model_extra["reasoning_content"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


def test_the_follow_up_with_the_tool_result_renders_as_transformers_renders_it(served, client, transformers_tokenizer):
    _, sampler, prompts = served
    sampler.say(THINK_THEN_CALL)
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER]).choices[0].message
    call = first.tool_calls[0]
    sent_back = first.model_dump(exclude_none=True)  # what agents send back: reasoning_content included
    assert sent_back["reasoning_content"] == "The user wants the weather; call the tool."
    follow_up = [
        *QUESTION,
        sent_back,
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'},
    ]
    sampler.say("<think>\nReport it.\n</think>\n\nIt is 18 °C and clear in Paris.")
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER])
    assert prompts[-1] == expected_prompt(transformers_tokenizer, follow_up, [WEATHER])
    assert '<tool_response>\n{"temp_c": 18, "sky": "clear"}\n</tool_response>' in prompts[-1]
    assert prompts[-2] + THINK_THEN_CALL in prompts[-1]  # the turn renders back to what the model wrote
    hf_ids = transformers_tokenizer.apply_chat_template(
        follow_up, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert sampler.tokenizer.encode(prompts[-1]) == list(hf_ids)  # the engine's ids are transformers' ids
    assert answer.usage.prompt_tokens == len(hf_ids)
    message = answer.choices[0].message
    assert (message.content, message.tool_calls, answer.choices[0].finish_reason) == (
        "It is 18 °C and clear in Paris.",
        None,
        "stop",
    )
    assert message.model_extra["reasoning_content"] == "Report it."


def test_enable_thinking_false_reaches_the_template(served, client, transformers_tokenizer):
    _, sampler, prompts = served
    sampler.say("Hello.")
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert prompts[-1] == expected_prompt(transformers_tokenizer, QUESTION, enable_thinking=False)
    assert prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reply.choices[0].message.content == "Hello."
    assert "reasoning_content" not in reply.choices[0].message.model_extra


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("tool_choice", "forced", "script"),
    [
        ("required", "", '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"name": "get_weather", "arguments": ',
            '{"city": "Oslo"}}\n</tool_call>',
        ),
    ],
    ids=["required", "named"],
)
def test_forced_tool_choice_starts_the_turn_with_a_call(
    served, client, transformers_tokenizer, tool_choice, forced, script, stream
):
    _, sampler, prompts = served
    sampler.say(script)
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice, stream=stream
    )
    rendered = expected_prompt(transformers_tokenizer, QUESTION, [WEATHER])
    assert prompts[-1] == rendered + "<think>\n\n</think>\n\n<tool_call>\n" + forced  # the turn opens with a call
    _, [(name, arguments)], reason = reply_parts(response, stream)
    assert (name, json.loads(arguments), reason) == ("get_weather", {"city": "Oslo"}, "tool_calls")


UNKNOWN_TOOL = '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>'
NOT_A_CALL = '<tool_call>\n{"function": "get_weather", "city": "Paris"}\n</tool_call>'
BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "stream"),
    [(UNKNOWN_TOOL, False), (NOT_A_CALL, False), (BAD_JSON, False), (UNKNOWN_TOOL, True), (NOT_A_CALL, True)],
    ids=["unknown_tool", "not_a_call", "bad_json", "unknown_tool_streamed", "not_a_call_streamed"],
)
def test_malformed_tool_call_text_is_plain_content_not_an_error(served, client, text, stream):
    _, sampler, _ = served
    sampler.say("Let me look. " + text)
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], stream=stream)
    assert reply_parts(response, stream) == ("Let me look. " + text, [], "stop")


def test_json_that_breaks_after_a_streamed_call_began_keeps_the_text_as_written(served, client):
    """The documented streaming limit: a call announced (name seen) cannot be taken back."""
    _, sampler, _ = served
    sampler.say(BAD_JSON)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], stream=True))
    (call,) = streamed_calls(chunks)
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": }')


def test_bad_tool_fields_are_400s_naming_the_field(client):
    bad = [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=extra)
        assert error.value.body["param"] == param, extra
    broken_history = [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather"}}]}]
    with pytest.raises(openai.BadRequestError, match="messages\\[2\\].tool_calls\\[0\\]"):
        client.chat.completions.create(model=MODEL, messages=broken_history)


def test_a_family_without_a_tool_parser_refuses_tools():
    setup = ChatSetup(template=ChatTemplate.from_source("{{ messages[0].content }}"), family=PLAIN, end_tokens={})
    request = parse_chat_request({"messages": QUESTION, "tools": [WEATHER]})
    with pytest.raises(APIError, match="chat family 'plain' has no tool-call parser") as error:
        prepare_turn(setup, request, streaming=False)
    assert error.value.param == "tools"
    assert prepare_turn(setup, parse_chat_request({"messages": QUESTION}), streaming=False).prompt == "You are terse."


def test_websocket_chat_starts_take_tools_and_stream_parsed_deltas(served, transformers_tokenizer):
    server, sampler, prompts = served
    sampler.say(THINK_THEN_CALL)
    start = {
        "type": "start",
        "id": 7,
        "messages": QUESTION,
        "tools": [WEATHER],
        "chat_template_kwargs": {"enable_thinking": True},
        "params": {"max_tokens": 200},
    }
    deltas, done = ws_generation(server.ws_url, start)
    assert prompts[-1] == expected_prompt(transformers_tokenizer, QUESTION, [WEATHER], enable_thinking=True)
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris", "units": "°C"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather; call the tool."


def test_serve_rejects_a_bad_chat_template_or_parser_before_serving(capsys, tiny_target, tmp_path):
    from pdflash.cli import main

    serve = ["serve", "--target", str(tiny_target), "--no-spec"]
    assert main([*serve, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "missing.jinja' is not a file" in capsys.readouterr().err
    assert main([*serve, "--chat-parser", "bogus"]) == 2
    assert (
        "chat_parser='bogus' is invalid; choose auto or one of ['harmony', 'plain', 'qwen3']" in capsys.readouterr().err
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    assert main([*serve, "--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "broken.jinja'" in err and "does not compile" in err


def test_websocket_chat_fields_are_checked_like_the_http_ones(served):
    server, _, _ = served
    bad = [
        ({"prompt": "hi", "tools": [WEATHER]}, "invalid_message", "tools"),
        ({"messages": QUESTION, "tool_choice": "required"}, "invalid_request", "tool_choice"),
        ({"messages": QUESTION, "chat_template_kwargs": 1}, "invalid_request", "chat_template_kwargs"),
    ]
    with connect(server.ws_url) as ws:
        for i, (fields, code, param) in enumerate(bad):
            ws.send(json.dumps({"type": "start", "id": i, **fields}))
            msg = json.loads(ws.recv())
            while msg["type"] == "stats":
                msg = json.loads(ws.recv())
            assert (msg["type"], msg["id"], msg["code"], msg["param"]) == ("error", i, code, param)


def test_messages_reach_the_template_as_transformers_passes_them(transformers_tokenizer):
    """Null content is left out (not ""), text parts are joined, tool-call fields pass through."""
    template = "{% for m in messages %}[{{ m.content is defined }}|{{ m.content }}|{{ m.get('tool_calls') | tojson }}]{% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    ours = ChatTemplate.from_source(template).render(parse_chat_request({"messages": messages}).messages)
    joined = [{**messages[0], "content": "Weather in Oslo?"}, *messages[1:]]
    assert ours == transformers_tokenizer.apply_chat_template(
        joined, chat_template=template, tokenize=False, add_generation_prompt=True
    )
