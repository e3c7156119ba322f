"""The harmony chat format of gpt-oss: its special tokens and a chat template that renders it.

The template was written for pdflash after the published gpt-oss `chat_template` (whose text is
not shipped here): the system header with model identity, knowledge cutoff, the current date
(`strftime_now`) and reasoning effort; a leading system or developer message becomes the
developer `# Instructions`; past assistant turns keep their `final` channel (and `analysis`,
from a `thinking` field, only after the last user turn); the generation prompt is
`<|start|>assistant`. Tools are not rendered.
"""

from __future__ import annotations

HARMONY_SPECIAL_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    "<|mask|>",
)

HARMONY_TEMPLATE = (
    "{%- if model_identity is not defined %}"
    "{%- set model_identity = 'You are ChatGPT, a large language model trained by OpenAI.' %}"
    "{%- endif %}"
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|start|>system<|message|>{{ model_identity }}\n"
    "Knowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') %}"
    "<|start|>developer<|message|># Instructions\n\n{{ messages[0]['content'] }}\n\n<|end|>"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "<|start|>user<|message|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message.get('thinking') and loop.index0 > ns.last_user %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message['thinking'] }}<|end|>"
    "{%- endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}"
    "{%- if loop.last and not add_generation_prompt %}<|return|>{%- else %}<|end|>{%- endif %}"
    "{%- else %}"
    "{{- raise_exception('harmony messages take roles system, developer, user, assistant; got ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
