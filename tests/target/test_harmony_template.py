"""The harmony chat template of `make-tiny --family gpt-oss` renders as transformers renders it."""

import pytest

from pdflash.target.tiny_gpt_oss import TINY_GPT_OSS_CONFIG, write_tiny_gpt_oss
from pdflash.target.tokenizer import TextTokenizer

CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris", "thinking": "The user wants a capital."},
        {"role": "user", "content": "And of Italy?"},
    ],
    "developer_then_reasoned_reply": [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "Add them."},
    ],
    "no_system": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), num_hidden_layers=2, layer_types=None)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_template_renders_as_transformers(directory, name, add_generation_prompt):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(directory)
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = TextTokenizer(directory, TINY_GPT_OSS_CONFIG["vocab_size"])
    assert ours.chat_template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_system_prompt_becomes_developer_instructions(directory):
    text = TextTokenizer(directory, TINY_GPT_OSS_CONFIG["vocab_size"]).chat_template.render(
        CONVERSATIONS["system_multi_turn"]
    )
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in one word.\n\n<|end|>" in text
    assert "The user wants a capital." not in text  # reasoning before the last user turn is dropped
    assert text.endswith("<|start|>user<|message|>And of Italy?<|end|><|start|>assistant")


def test_unknown_role_is_rejected_naming_it(directory):
    tokenizer = TextTokenizer(directory, TINY_GPT_OSS_CONFIG["vocab_size"])
    with pytest.raises(ValueError, match="got system"):  # only the first message may be system / developer
        tokenizer.chat_template.render([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])
