"""gpt-oss harmony: tool calls on the commentary channel, and the template that renders them back.

Oracles: (1) `transformers`' `apply_chat_template` on the tiny gpt-oss tokenizer directory
(the harmony template `make-tiny --family gpt-oss` ships) renders every conversation — tools,
calls, tool results, multi-turn — byte for byte as pdflash does; (2) a parsed turn sent back
as an assistant message renders to exactly the text the model wrote; (3) streaming is
split-invariant — any chunking of the text assembles to the whole response.
"""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.chat.deltas import ChatMessage
from pdflash.chat.families import HARMONY, ToolChoice, TurnSetup
from pdflash.chat.harmony import Header
from pdflash.target.tiny_gpt_oss import TINY_GPT_OSS_CONFIG, write_harmony_tokenizer
from pdflash.target.tokenizer import TextTokenizer

NAMES = frozenset({"get_weather", "now"})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Current weather — °C, <b>&</b> "quoted"',
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                    "days": {"type": "array", "items": {"type": "integer"}},
                    "detail": {"type": ["string", "null"]},
                    "hourly": {"type": "boolean", "nullable": True},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
CALL_DICT_ARGS = {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {"tz": "<UTC>"}}}
WEATHER_CALL = (  # what gpt-oss writes after the prompt's <|start|>assistant
    "<|channel|>analysis<|message|>Need the weather; use the tool.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    "<|call|>"
)
CONVERSATIONS = {
    "tools_offered": [{"role": "user", "content": "Weather in Zürich?"}],
    "tools_and_instructions": [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Weather in Zürich?"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ],
    "parallel_calls_answered_out_of_order": [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "thinking": "two tools",
            "tool_calls": [CALL, CALL_DICT_ARGS],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "tool", "content": "sunny"},  # no id: the first call still pending (get_weather)
    ],
    "multi_turn_after_tool_results": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "thinking": "old reasoning, dropped", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "thinking": "also dropped"},
        {"role": "user", "content": "And the time?"},
        {"role": "assistant", "thinking": "kept: after the last user turn", "tool_calls": [CALL_DICT_ARGS]},
        {"role": "tool", "name": "now", "content": "12:00"},
    ],
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harmony-tokenizer")
    write_harmony_tokenizer(directory, dict(TINY_GPT_OSS_CONFIG))
    return directory


@pytest.fixture(scope="module")
def template(directory):
    return TextTokenizer(directory, TINY_GPT_OSS_CONFIG["vocab_size"]).chat_template


@pytest.fixture(scope="module")
def reference(directory):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parser(*, streaming, tool_names=NAMES, max_calls=None):
    setup = TurnSetup(prompt="", tool_names=tool_names, streaming=streaming, max_calls=max_calls, new_id=ids())
    return HARMONY.new_parser(setup)


def run(p, chunks) -> ChatMessage:
    return ChatMessage.assemble([*(p.feed(c, ()) for c in chunks), p.finish()])


def whole(text, **kw) -> ChatMessage:
    return run(parser(streaming=False, **kw), [text])


# -- rendering ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_tool_conversations_render_as_transformers_renders_them(template, reference, name):
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert template.render(messages, tools=TOOLS) == expected


def test_template_kwargs_and_no_tools_render_as_transformers_renders_them(template, reference):
    messages = CONVERSATIONS["tool_round_trip"]
    kwargs = {"reasoning_effort": "high", "model_identity": "You are a test model."}
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert template.render(messages, **kwargs) == expected


def test_the_rendered_tools_and_calls_are_harmony(template):
    text = template.render(CONVERSATIONS["parallel_calls_answered_out_of_order"], tools=TOOLS)
    assert (
        "Channel must be included for every message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
        in text
    )
    assert (
        "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        '// Current weather — °C, <b>&</b> "quoted"\ntype get_weather = (_: {\n// e.g. Zürich\ncity: string,\n'
        'unit?: "c" | "f", // default: "c"\ndays?: number[],\ndetail?: string | null,\nhourly?: boolean | null,\n'
        "}) => any;\n\n// The time\ntype now = () => any;\n\n} // namespace functions<|end|>"
    ) in text
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>two tools<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.now <|constrain|>json<|message|>{"tz": "<UTC>"}<|call|>'
        "<|start|>functions.now to=assistant<|channel|>commentary<|message|>12:00<|end|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant"
    )


def test_a_tool_result_without_a_pending_call_is_refused(template):
    from pdflash.chat.template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="a tool message must answer a call"):
        template.render([{"role": "user", "content": "q"}, {"role": "tool", "content": "orphan"}])


def test_a_parsed_call_sent_back_renders_to_exactly_what_the_model_wrote(template, reference):
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = reference.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    message = whole(WEATHER_CALL)
    (call,) = message.tool_calls
    sent_back = {
        "role": "assistant",
        "reasoning_content": message.reasoning,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ],
    }
    follow_up = [*history, sent_back, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    rendered = reference.apply_chat_template(follow_up, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert template.render(follow_up, tools=TOOLS) == rendered
    assert rendered.startswith(prompt + WEATHER_CALL + "<|start|>functions.get_weather to=assistant")


# -- parsing --------------------------------------------------------------------------------------------


def test_a_commentary_call_becomes_a_tool_call_and_analysis_reasoning():
    message = whole(WEATHER_CALL)
    assert (message.reasoning, message.content) == ("Need the weather; use the tool.", "")
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [("call_0", "get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.now <|constrain|>json",  # what gpt-oss writes
        "<|channel|>commentary to=functions.now",  # no content type
        "<|start|>assistant to=functions.now<|channel|>commentary json",  # the recipient before the channel
    ],
)
def test_the_recipient_is_read_wherever_the_header_puts_it(header):
    assert Header.parse(header) == Header(channel="commentary", recipient="functions.now")
    start = "" if header.startswith("<|start|>") else "<|start|>assistant"
    message = whole(f'<|channel|>final<|message|>x<|end|>{start}{header}<|message|>{{"tz": "UTC"}}<|call|>')
    assert message.content == "x"
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [("now", {"tz": "UTC"})]


MALFORMED = {
    "unknown_function": ("<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>", "{}"),
    "builtin_recipient": ('<|channel|>commentary to=browser.search<|message|>{"q": "x"}<|call|>', '{"q": "x"}'),
    "bad_json": ('<|channel|>commentary to=functions.now<|message|>{"tz": }<|call|>', '{"tz": }'),
    "not_an_object": ("<|channel|>commentary to=functions.now<|message|>[1, 2]<|call|>", "[1, 2]"),
    "plain_text": ("<|channel|>commentary to=functions.now<|message|>the time please<|call|>", "the time please"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_calls_come_back_as_plain_content(name):
    text, content = MALFORMED[name]
    assert (whole(text).content, whole(text).tool_calls) == (content, ())


@pytest.mark.parametrize("name", ["unknown_function", "builtin_recipient", "not_an_object", "plain_text"])
def test_malformed_calls_that_never_look_like_one_stream_as_content_too(name):
    text, content = MALFORMED[name]
    message = run(parser(streaming=True), list(text))
    assert (message.content, message.tool_calls) == (content, ())


def test_a_streamed_call_announced_before_its_json_breaks_keeps_what_was_sent():
    message = run(parser(streaming=True), list(MALFORMED["bad_json"][0]))
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("now", '{"tz": }')]


def test_without_tools_a_call_is_content():
    message = whole(WEATHER_CALL, tool_names=None)
    assert (message.content, message.tool_calls) == ('{"city": "Oslo"}', ())


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    second = "<|start|>assistant<|channel|>commentary to=functions.now<|message|>{}<|call|>"
    for streaming in (False, True):
        message = run(parser(streaming=streaming, max_calls=1), [WEATHER_CALL, second])
        assert [c.name for c in message.tool_calls] == ["get_weather"]


def test_streamed_arguments_arrive_piece_by_piece_before_the_call_ends():
    p = parser(streaming=True)
    deltas = [p.feed(c, ()) for c in WEATHER_CALL.removesuffix("<|call|>")]
    pieces = [d for delta in deltas for d in delta.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id == "call_0"
    assert len(pieces) > 5 and "".join(d.arguments for d in pieces) == '{"city": "Oslo"}'
    assert p.finish().empty  # the stop token was the call's end: nothing was held back


def test_a_body_cut_off_by_the_stop_token_is_closed_at_finish():
    message = whole(WEATHER_CALL.removesuffix("<|call|>"))  # the engine stops on <|call|>, dropped as end token
    assert [c.name for c in message.tool_calls] == ["get_weather"]


def test_forcing_prefixes_open_the_turn_with_a_call_and_parse_as_one():
    required = HARMONY.forcing_prefix("<|start|>assistant", ToolChoice(mode="required"))
    assert required == "<|channel|>commentary to=functions."
    named = HARMONY.forcing_prefix("<|start|>assistant", ToolChoice(mode="function", name="now"))
    assert named == "<|channel|>commentary to=functions.now <|constrain|>json<|message|>"
    for prefix, rest in [(required, 'now <|constrain|>json<|message|>{"tz": "UTC"}'), (named, '{"tz": "UTC"}')]:
        message = whole(prefix + rest)
        assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [("now", {"tz": "UTC"})]


SCRIPTS = [WEATHER_CALL, *(text for name, (text, _) in MALFORMED.items() if name != "bad_json")]


@settings(max_examples=200, deadline=None)
@given(script=st.sampled_from(SCRIPTS), cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_any_chunking_of_a_stream_assembles_to_the_whole_response(script, cuts):
    points = sorted({c % (len(script) + 1) for c in cuts})
    chunks = [script[a:b] for a, b in zip([0, *points], [*points, len(script)])]
    assert run(parser(streaming=True), chunks) == whole(script)
