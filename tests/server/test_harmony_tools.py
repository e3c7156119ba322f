"""gpt-oss tool calls through the OpenAI API: the official `openai` client against a real server
(uvicorn, the engine, the tiny random gpt-oss checkpoint and its harmony template).

The model output is steered by `ScriptedSampler` (tests/scripted_output.py), a test double of
the sampling function only; everything else is real. The checkpoint's EOS list is cut to
`<|return|>` alone, as the published gpt-oss `config.json` has it, so that a turn ending at
`<|call|>` shows the harmony family's own stop token at work. Rendered prompts are checked
against `transformers`' `apply_chat_template` on the same checkpoint directory.
"""

import json

import openai
import pytest
from scripted_output import WEATHER, ScriptedSampler, record_prompts, reply_parts, streamed_calls, ws_generation

import pdflash.spec.speculator
from pdflash.engine.async_engine import AsyncEngine
from pdflash.server import BackgroundServer, ServerSettings, create_app
from pdflash.target.tiny_gpt_oss import write_tiny_gpt_oss

MODEL = "tiny-gpt-oss"
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
REASONING = "The user wants the weather; call the tool."
CALL = (  # what gpt-oss writes after the prompt's <|start|>assistant
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "units": "°C"}<|call|>'
)
AFTER_THE_CALL = "<|start|>assistant<|channel|>final<|message|>LEAKED<|return|>"  # never generated: <|call|> stops


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), num_hidden_layers=2, layer_types=None)
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = config["eos_token_id"][0]  # <|return|> only, as the published config.json
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def served(checkpoint):
    """(server, sampler, prompts the engine was asked to continue, the engine's tokenizer)."""
    engine = AsyncEngine.from_pretrained(checkpoint, None, max_num_seqs=2)
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    assert eos == engine.tokenizer.token_id("<|return|>") != engine.tokenizer.token_id("<|call|>")
    prompts = record_prompts(engine)
    sampler = ScriptedSampler(engine.tokenizer, end="<|return|>")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pdflash.spec.speculator, "sample", sampler)
        with BackgroundServer(create_app(engine, ServerSettings(model_name=MODEL, default_max_tokens=200))) as server:
            yield server, sampler, prompts, engine.tokenizer


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


def rendered(reference, messages, tools=None):
    return reference.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def test_a_commentary_call_comes_back_as_tool_calls_and_ends_the_turn(served, client, reference):
    _, sampler, prompts, tokenizer = served
    sampler.say(CALL + AFTER_THE_CALL)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
    assert prompts[-1] == rendered(reference, QUESTION, [WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "units": "°C"}
    assert whole.usage.completion_tokens == len(tokenizer.encode(CALL))  # generation ended at <|call|>

    sampler.say(CALL + AFTER_THE_CALL)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], stream=True))
    (streamed,) = streamed_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments)
    assert streamed["pieces"] > 3  # arguments arrived incrementally, not in one piece
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == REASONING
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


def test_the_follow_up_with_the_tool_result_renders_as_transformers_renders_it(served, client, reference):
    _, sampler, prompts, tokenizer = served
    sampler.say(CALL)
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER]).choices[0].message
    sent_back = first.model_dump(exclude_none=True)  # what agents send back: reasoning_content included
    follow_up = [
        *QUESTION,
        sent_back,
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temp_c": 18, "sky": "clear"}'},
    ]
    sampler.say("<|channel|>final<|message|>It is 18 °C and clear in Paris.<|return|>")
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER])
    assert prompts[-1] == rendered(reference, follow_up, [WEATHER])
    assert prompts[-2] + CALL in prompts[-1]  # the turn renders back to what the model wrote
    assert prompts[-1].endswith(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp_c": 18, "sky": "clear"}'
        "<|end|><|start|>assistant"
    )
    hf_ids = reference.apply_chat_template(
        follow_up, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.encode(prompts[-1]) == list(hf_ids) and answer.usage.prompt_tokens == len(hf_ids)
    message = answer.choices[0].message
    assert (message.content, message.tool_calls, answer.choices[0].finish_reason) == (
        "It is 18 °C and clear in Paris.",
        None,
        "stop",
    )


UNKNOWN_FUNCTION = "<|channel|>commentary to=functions.delete_everything <|constrain|>json<|message|>{}<|call|>"
BAD_JSON = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": }<|call|>'
NOT_JSON = "<|channel|>commentary to=functions.get_weather<|message|>Paris, please<|call|>"


@pytest.mark.parametrize(
    ("text", "content", "stream"),
    [
        (UNKNOWN_FUNCTION, "{}", False),
        (UNKNOWN_FUNCTION, "{}", True),
        (BAD_JSON, '{"city": }', False),
        (NOT_JSON, "Paris, please", False),
        (NOT_JSON, "Paris, please", True),
    ],
    ids=["unknown_function", "unknown_function_streamed", "bad_json", "not_json", "not_json_streamed"],
)
def test_malformed_calls_are_plain_content_not_an_error(served, client, text, content, stream):
    _, sampler, _, _ = served
    sampler.say(text)
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], stream=stream)
    assert reply_parts(response, stream) == (content, [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_opens_the_turn_with_that_call(served, client, reference, stream):
    _, sampler, prompts, _ = served
    sampler.say('{"city": "Oslo"}<|call|>')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=choice, stream=stream
    )
    forced = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert prompts[-1] == rendered(reference, QUESTION, [WEATHER]) + forced
    _, [(name, arguments)], reason = reply_parts(response, stream)
    assert (name, json.loads(arguments), reason) == ("get_weather", {"city": "Oslo"}, "tool_calls")


def test_websocket_chat_streams_the_call_and_ends_with_tool_calls(served, reference):
    server, sampler, prompts, _ = served
    sampler.say(CALL + AFTER_THE_CALL)
    start = {"type": "start", "id": 3, "messages": QUESTION, "tools": [WEATHER], "params": {"max_tokens": 200}}
    deltas, done = ws_generation(server.ws_url, start)
    assert prompts[-1] == rendered(reference, QUESTION, [WEATHER])
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris", "units": "°C"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("content", "") for d in deltas) == ""  # nothing after the <|call|> was generated
