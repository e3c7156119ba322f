"""Chat templates render byte for byte as `transformers`' `apply_chat_template` renders them.

The oracle is `transformers` itself, loading the same checkpoint directory. The Qwen3
template (tests/chat/fixtures/qwen3_chat_template.jinja) is the published Qwen3 / Qwen3-MoE
template, written into the fixture from memory (the real ones are not on this machine).
"""

import json
from pathlib import Path

import jinja2
import pytest

from pdflash.chat.template import ChatTemplate, ChatTemplateError
from pdflash.target.tiny import byte_level_tokenizer

QWEN3 = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
QWEN3_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Current weather in a city — °C, <b>&</b> "quoted"',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
CALL_DICT_ARGS = {"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC", "fmt": "<iso>"}}}

CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    "user_only": [{"role": "user", "content": "What is 2+2? Ünïcode ✓"}],
    "multi_turn_thinking_history": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nplan A\n</think>\n\nanswer one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two", "reasoning_content": "plan B"},
        {"role": "user", "content": "third"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ],
    "parallel_calls_and_results": [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "reasoning_content": "two tools",
            "tool_calls": [CALL, CALL_DICT_ARGS],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "Sunny at noon."},
        {"role": "user", "content": "<tool_response>\nnot really a tool\n</tool_response>"},
    ],
}


def write_checkpoint(directory: Path, template, special=QWEN3_SPECIAL, *, jinja_file: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (directory / "chat_template.jinja").write_text(jinja_file)
    return directory


def hf_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    directory = write_checkpoint(tmp_path_factory.mktemp("qwen3"), QWEN3)
    return ChatTemplate.from_checkpoint(directory), hf_tokenizer(directory)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}], ids=str)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3_template_renders_as_transformers_does(qwen3_pair, name, tools, kwargs):
    ours, hf = qwen3_pair
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    assert ours.render(messages, tools=tools, **kwargs) == expected
    closed = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False, **kwargs)
    assert ours.render(messages, tools=tools, add_generation_prompt=False, **kwargs) == closed


def test_qwen3_renders_tools_and_thinking_switch_the_way_the_model_expects(qwen3_pair):
    """Not an oracle (transformers is): a guard that the fixture exercises the branches it is meant to."""
    ours, _ = qwen3_pair
    off = ours.render(CONVERSATIONS["tool_round_trip"], tools=TOOLS, enable_thinking=False)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in off  # tojson: no HTML escaping, no \u escapes
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in off
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in off
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


FEATURE_TEMPLATES = {
    "loopcontrols": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
    "{% continue %}x{% endfor %}",
    "tojson_options": "{{ tools | tojson(indent=2) }}|{{ tools | tojson(sort_keys=true, separators=(',', ':')) }}"
    "|{{ messages[0].content | tojson(ensure_ascii=true) }}",
    "strftime_now": "{{ strftime_now('%Y-%m-%d') }}:{{ messages | length }}",
    "namespace_and_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }}{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['k']) | tojson }}",
    "generation_block": "{% for m in messages %}{% generation %}{{ m.role }}:{{ m.content }}{% endgeneration %}"
    "{% endfor %}",
    "special_tokens": "[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}][{{ unk_token }}]{{ messages[0].content }}",
    "documents": "{% for d in documents %}<{{ d.title }}>{{ d.text }}{% endfor %}{{ documents is none }}",
    "reasoning_aliases": "{% for m in messages %}{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.reasoning }};"
    "{% endfor %}",
    "null_keys_dropped": "{% for m in messages %}{{ m.tool_calls is defined }}{{ m.name is defined }}{% endfor %}",
    "whitespace_control": "{% if true %}\n  {{ messages[0].content }}\n{% endif %}\n  {%- for m in messages %}"
    "\n    [{{ m.role }}]\n{% endfor %}",
    "kwargs_override_tokens": "{{ eos_token }}|{{ custom }}|{{ add_generation_prompt }}",
}
FEATURE_MESSAGES = [
    {"role": "user", "content": "a <b> & ü", "name": None, "tool_calls": None},
    {"role": "assistant", "content": "c", "reasoning": "r1"},
    {"role": "assistant", "content": "d", "thinking": "t2", "reasoning_content": "rc2"},
]
DOCUMENTS = [{"title": "T1", "text": "one"}, {"title": "T2", "text": "two"}]


@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_environment_features_render_as_transformers_does(tmp_path, name):
    special = {
        "eos_token": "<|endoftext|>",
        "bos_token": "<|im_start|>",
        "pad_token": {"__type": "AddedToken", "content": "<|mask|>", "special": True},
    }
    directory = write_checkpoint(tmp_path, FEATURE_TEMPLATES[name], special)
    ours, hf = ChatTemplate.from_checkpoint(directory), hf_tokenizer(directory)
    extra = {"custom": [1, "x"], "eos_token": "<override>"} if name == "kwargs_override_tokens" else {}
    documents = DOCUMENTS if name == "documents" else None
    expected = hf.apply_chat_template(
        FEATURE_MESSAGES, tools=TOOLS, documents=documents, add_generation_prompt=True, tokenize=False, **extra
    )
    assert ours.render(FEATURE_MESSAGES, tools=TOOLS, documents=documents, **extra) == expected


def test_template_files_and_named_templates_are_chosen_as_transformers_chooses(tmp_path):
    named = [{"name": "default", "template": "D{{ tools is none }}"}, {"name": "tool_use", "template": "T"}]
    d1 = write_checkpoint(tmp_path / "named", named)
    d2 = write_checkpoint(tmp_path / "file", "from config", jinja_file="from file {{ messages[0].content }}")
    messages = [{"role": "user", "content": "hi"}]
    for directory in (d1, d2):
        ours, hf = ChatTemplate.from_checkpoint(directory), hf_tokenizer(directory)
        for tools in (None, TOOLS):
            assert ours.render(messages, tools=tools) == hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
    assert ChatTemplate.from_checkpoint(write_checkpoint(tmp_path / "none", None)) is None


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('roles must alternate') }}",
        "{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace(_secret=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    ],
    ids=["raise_exception", "dunder", "namespace_underscore_init", "namespace_underscore_set", "mutation"],
)
def test_templates_that_transformers_refuses_are_refused(tmp_path, template):
    directory = write_checkpoint(tmp_path, template)
    ours, hf = ChatTemplate.from_checkpoint(directory), hf_tokenizer(directory)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as mine:
        ours.render(messages)
    if "raise_exception" in template or "__class__" in template:  # the sandbox's and the author's own words
        assert str(mine.value) == str(theirs.value)


def test_bad_requests_to_render_name_the_problem():
    template = ChatTemplate.from_source("{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        template.render([])
    with pytest.raises(ChatTemplateError, match="failed on this input: TypeError"):
        ChatTemplate.from_source("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no default"):
        ChatTemplate(templates={"a": "A", "b": "B"}).render([{"role": "user", "content": "x"}])
