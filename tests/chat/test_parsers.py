"""Output parsers: Qwen3's <think> reasoning and hermes <tool_call> blocks, whole and streamed.

Oracles: (1) the chat template itself — a parsed turn, sent back as an assistant message,
renders (through `transformers`) to exactly the text the model wrote; (2) streaming is
split-invariant — any chunking of the text assembles to the whole response.
"""

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.chat.deltas import ChatMessage
from pdflash.chat.families import HARMONY, PLAIN, QWEN3, ToolChoice, TurnSetup, family_for
from pdflash.chat.reasoning import ThinkReasoning
from pdflash.chat.tool_parsers import parse_call, scan_head

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
NAMES = frozenset({"get_weather", "now"})
CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "a \\"q\\" } ]"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
WELL_FORMED = {
    "think_content": "<think>\nLet me think.\n\nMore.\n</think>\n\nThe answer is 4.",
    "think_call": "<think>\nNeed weather.\n</think>\n\n" + CALL_1,
    "content_then_calls": "<think>\nok\n</think>\n\nChecking both.\n" + CALL_1 + "\n" + CALL_2,
    "empty_think_call": "<think>\n\n</think>\n\n" + CALL_2,
    "plain": "Just text, no tags. 3 < 4 > 2",
    "tag_in_string": '<think>\n\n</think>\n\n<tool_call>\n{"name": "now", "arguments": {"s": "</tool_call>"}}\n</tool_call>',
}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def qwen3_parser(*, streaming, prompt="<|im_start|>assistant\n", tool_names=NAMES, max_calls=None):
    setup = TurnSetup(prompt=prompt, tool_names=tool_names, streaming=streaming, max_calls=max_calls, new_id=ids())
    return QWEN3.new_parser(setup)


def run(parser, chunks) -> ChatMessage:
    deltas = [parser.feed(c, ()) for c in chunks]
    return ChatMessage.assemble([*deltas, parser.finish()])


def whole(text, **kw) -> ChatMessage:
    return run(qwen3_parser(streaming=False, **kw), [text])


# -- reasoning ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "text", "expected"),
    [
        ("start", "<think>\nR1\nR2\n</think>\n\nC", ("R1\nR2", "C")),
        ("start", "  <think>R</think>C", ("R", "C")),
        ("start", "no think here </think>", ("", "no think here </think>")),
        ("start", "<thin", ("", "<thin")),
        ("start", "<think>\ntruncated\n", ("truncated\n", "")),
        ("start", "answer <think>x</think>", ("", "answer <think>x</think>")),
        ("reasoning", "\nR\n</think>\n\nC", ("R", "C")),
        ("content", "<think>x</think>", ("", "<think>x</think>")),
    ],
)
def test_think_reasoning_splits_reasoning_from_content(state, text, expected):
    for chunks in ([text], list(text)):  # whole, and one character at a time
        parser = ThinkReasoning(state=state)
        parts = [parser.feed(c) for c in chunks] + [parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected


def test_a_bad_reasoning_state_is_refused():
    with pytest.raises(ValueError, match="state='thinking' is invalid"):
        ThinkReasoning(state="thinking")


# -- tool calls ---------------------------------------------------------------------------------------


def test_whole_response_calls_have_the_models_argument_text_and_valid_json():
    message = whole(WELL_FORMED["content_then_calls"])
    assert message.reasoning == "ok" and message.content == "Checking both."
    assert [(c.id, c.name) for c in message.tool_calls] == [("call_0", "get_weather"), ("call_1", "now")]
    assert json.loads(message.tool_calls[0].arguments) == {"city": "Zürich", "note": 'a "q" } ]'}
    assert message.tool_calls[0].arguments == '{"city": "Zürich", "note": "a \\"q\\" } ]"}'
    assert message.tool_calls[1].arguments == "{}"


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not an offered tool
        '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["now", {}]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "now", "arguments": "not json"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # truncated
    ],
)
def test_malformed_tool_call_text_comes_back_as_plain_content(block):
    text = "Before. " + block
    message = whole(text)
    assert message.tool_calls == () and message.content == text


def test_unusual_but_valid_call_forms_are_accepted():
    reordered = whole('<tool_call>{"arguments": {"a": 1}, "name": "now"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in reordered.tool_calls] == [("now", {"a": 1})]
    as_string = whole('<tool_call>{"name": "now", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert json.loads(as_string.tool_calls[0].arguments) == {"a": 2}
    unclosed = whole('<tool_call>\n{"name": "now", "arguments": {"b": 3}}\n')  # ended before </tool_call>
    assert json.loads(unclosed.tool_calls[0].arguments) == {"b": 3}


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = WELL_FORMED["content_then_calls"]
    assert [c.name for c in whole(text, max_calls=1).tool_calls] == ["get_weather"]
    assert [c.name for c in run(qwen3_parser(streaming=True, max_calls=1), list(text)).tool_calls] == ["get_weather"]


def test_without_tools_nothing_is_parsed_as_a_call():
    message = whole(WELL_FORMED["think_call"], tool_names=None)
    assert message.tool_calls == () and message.content == CALL_1 and message.reasoning == "Need weather."


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(WELL_FORMED)), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_chunking_of_a_stream_assembles_to_the_whole_response(name, cuts):
    text = WELL_FORMED[name]
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert run(qwen3_parser(streaming=True), chunks) == whole(text)


def test_streamed_arguments_arrive_piece_by_piece_before_the_call_closes():
    parser = qwen3_parser(streaming=True)
    deltas = [parser.feed(c, ()) for c in WELL_FORMED["think_call"]]
    pieces = [(i, d) for i, delta in enumerate(deltas) for d in delta.tool_calls]
    first_at, first = pieces[0]
    assert (first.name, first.id, first.arguments) == ("get_weather", "call_0", "")
    argument_pieces = [d.arguments for _, d in pieces[1:]]
    assert len(argument_pieces) > 10  # one per character of the arguments
    assert json.loads("".join(argument_pieces)) == {"city": "Zürich", "note": 'a "q" } ]'}
    assert pieces[-1][0] < len(WELL_FORMED["think_call"]) - len("}\n</tool_call>")  # all sent before the close


def test_a_tool_call_tag_inside_an_argument_string_does_not_end_the_call():
    text = '<tool_call>\n{"name": "now", "arguments": {"code": "</tool_call> inside"}}\n</tool_call>after'
    for message in (run(qwen3_parser(streaming=True), list(text)), whole(text)):
        assert json.loads(message.tool_calls[0].arguments) == {"code": "</tool_call> inside"}
        assert message.content == "after"


def test_a_truncated_streamed_call_keeps_what_was_sent_and_the_whole_response_gives_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    streamed = run(qwen3_parser(streaming=True), list(text))
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [("get_weather", '{"city": "Par')]
    assert whole(text).content == text and whole(text).tool_calls == ()


def test_scan_head_tells_match_mismatch_and_not_yet():
    head = ' {"name" : "now",\n"arguments":  {'
    assert scan_head(head) == ("now", head.index("{", 2))
    assert scan_head('{"na') is None and scan_head('{"name": "no') is None
    assert scan_head('{"arguments": {}') is False and scan_head("[") is False
    assert parse_call("{") is None


# -- round trip through the template (transformers as the oracle) ----------------------------------


def _as_assistant_message(message: ChatMessage) -> dict:
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in message.tool_calls
    ]
    return {
        "role": "assistant",
        "content": message.content,
        "reasoning_content": message.reasoning,
        "tool_calls": calls or None,
    }


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_a_parsed_turn_sent_back_renders_to_exactly_what_the_model_wrote(tmp_path, name):
    from transformers import PreTrainedTokenizerFast

    from pdflash.target.tiny import byte_level_tokenizer

    byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="<|im_end|>")
    hf.chat_template = QWEN3_TEMPLATE
    history = [{"role": "user", "content": "q"}]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(NAMES)]
    prompt = hf.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
    model_text = WELL_FORMED[name] if "<think>" in WELL_FORMED[name] else "<think>\n\n</think>\n\n" + WELL_FORMED[name]
    message = whole(model_text, prompt=prompt)
    rendered = hf.apply_chat_template(history + [_as_assistant_message(message)], tools=tools, tokenize=False)
    assert rendered == prompt + model_text + "<|im_end|>\n"


# -- families ---------------------------------------------------------------------------------------------


def test_forcing_prefixes_open_the_turn_with_a_call_and_parse_as_one():
    prompt = "<|im_start|>assistant\n"
    required = QWEN3.forcing_prefix(prompt, ToolChoice(mode="required"))
    assert required == "<think>\n\n</think>\n\n<tool_call>\n"
    named = QWEN3.forcing_prefix(prompt + "<think>\n\n</think>\n\n", ToolChoice(mode="function", name="now"))
    assert named == '<tool_call>\n{"name": "now", "arguments": '
    message = whole(named + '{"tz": "UTC"}}\n</tool_call>', prompt=prompt + "<think>\n\n</think>\n\n")
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [("now", {"tz": "UTC"})]


def test_the_prompt_decides_where_the_turn_starts():
    no_think = whole("<think>kept</think>", prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (no_think.reasoning, no_think.content) == ("", "<think>kept</think>")
    opened = whole("R\n</think>\n\nC", prompt="<|im_start|>assistant\n<think>\n")
    assert (opened.reasoning, opened.content) == ("R", "C")


def test_families_are_picked_from_the_template_or_by_name():
    assert family_for("auto", QWEN3_TEMPLATE) is QWEN3
    assert family_for("auto", "{{ messages }}") is PLAIN and family_for("auto", None) is PLAIN
    assert family_for("plain", QWEN3_TEMPLATE) is PLAIN
    assert family_for("auto", "<|start|>{{ m }}<|channel|>final<|message|>") is HARMONY
    with pytest.raises(ValueError, match="'bogus' is not a chat family; choose auto or one of"):
        family_for("bogus", None)


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "\n",
    " ",
    '{"name": ',
    '"now"',
    '"get_weather"',
    ", ",
    '"arguments": ',
]
FRAGMENTS += ["{", "}", "[", "]", '"', "\\", ":", "1", "x", "é", "<think>", "</think>", '{"a": 1}', "null"]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_any_text_parses_without_error_and_text_without_calls_comes_back_whole(pieces, cuts):
    text = "".join(pieces)
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking off: the whole turn is the answer
    message = whole(text, prompt=prompt)
    if not message.tool_calls:
        assert message.content == text
    for call in message.tool_calls:
        assert call.name in NAMES and isinstance(json.loads(call.arguments), dict)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    run(qwen3_parser(streaming=True, prompt=prompt), chunks)  # streaming never raises either
