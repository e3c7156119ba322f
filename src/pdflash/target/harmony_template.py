"""The harmony chat format of gpt-oss: its special tokens and a chat template that renders it.

The template was written for pdflash after the published gpt-oss `chat_template` (whose text is
not shipped here): the system header with model identity, knowledge cutoff, the current date
(`strftime_now`) and reasoning effort; a leading system or developer message becomes the
developer `# Instructions`, and the request's tools its `# Tools` (a `functions` namespace of
TypeScript-like signatures); past assistant turns keep their `final` channel (and `analysis`,
from a `thinking` field, only after the last user turn); the generation prompt is
`<|start|>assistant`. Unlike the published template, a past tool call renders in the form
the model writes it (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
ARGS<|call|>`, ARGS the OpenAI `arguments` text as sent, or an object's JSON), and a tool
result's `content` goes in as it is (the harmony spec's form), not as a JSON string; a tool
message answers the pending call its `tool_call_id` (or `name`) names, else the first pending.
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

# `{type}` of a JSON schema in the TypeScript-like notation the harmony tool namespace uses
_TYPE_MACRO = (
    "{%- macro ts_type(spec) -%}"
    "{%- if spec.get('enum') -%}{{- '\"' + spec['enum']|join('\" | \"') + '\"' -}}"
    "{%- elif spec.get('type') is string and spec['type'] in ('number', 'integer') -%}{{- 'number' -}}"
    "{%- elif spec.get('type') in ('string', 'boolean', 'object') -%}{{- spec['type'] -}}"
    "{%- elif spec.get('type') == 'array' -%}{{- ts_type(spec.get('items') or {}) + '[]' -}}"
    "{%- elif spec.get('type') is sequence and spec.get('type') is not string -%}{{- spec['type']|join(' | ') -}}"
    "{%- else -%}{{- 'any' -}}"
    "{%- endif -%}"
    "{%- if spec.get('nullable') -%}{{- ' | null' -}}{%- endif -%}"
    "{%- endmacro -%}"
)

# the request's tools as `namespace functions { type NAME = (_: {...}) => any; }`
_NAMESPACE_MACRO = (
    "{%- macro functions_namespace(tools) -%}"
    "{{- '## functions\n\nnamespace functions {\n\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool.get('function') else tool -%}"
    "{%- if fn.get('description') -%}{{- '// ' + fn['description'] + '\n' -}}{%- endif -%}"
    "{{- 'type ' + fn['name'] + ' = ' -}}"
    "{%- set schema = fn.get('parameters') or {} -%}"
    "{%- if schema.get('properties') -%}"
    "{{- '(_: {\n' -}}"
    "{%- for name, spec in schema['properties'].items() -%}"
    "{%- if spec.get('description') -%}{{- '// ' + spec['description'] + '\n' -}}{%- endif -%}"
    "{{- name + ('' if name in (schema.get('required') or []) else '?') + ': ' + ts_type(spec) -}}"
    "{%- if spec.get('default') is not none -%}{{- ', // default: ' + spec['default']|tojson + '\n' -}}"
    "{%- else -%}{{- ',\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '}) => any;\n\n' -}}"
    "{%- else -%}{{- '() => any;\n\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- '} // namespace functions' -}}"
    "{%- endmacro -%}"
)

HARMONY_TEMPLATE = (
    _TYPE_MACRO + _NAMESPACE_MACRO + "{%- if model_identity is not defined %}"
    "{%- set model_identity = 'You are ChatGPT, a large language model trained by OpenAI.' %}"
    "{%- endif %}"
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|start|>system<|message|>{{ model_identity }}\n"
    "Knowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}{{- '\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}"
    "<|end|>"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') %}"
    "{%- set instructions = messages[0].get('content') %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set instructions = none %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if instructions or tools %}<|start|>developer<|message|>"
    "{%- if instructions %}{{- '# Instructions\n\n' + instructions + '\n\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\n\n' + functions_namespace(tools) }}{%- endif %}"
    "<|end|>"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1, pending=[]) %}"
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
    "{%- if message.get('tool_calls') %}"
    "{%- if message.get('content') %}"
    "<|start|>assistant<|channel|>commentary<|message|>{{ message['content'] }}<|end|>"
    "{%- endif %}"
    "{%- set ns.pending = [] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- set ns.pending = ns.pending + [[call.get('id'), fn['name']]] %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ fn['name'] }} <|constrain|>json<|message|>"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments']|tojson }}<|call|>"
    "{%- endfor %}"
    "{%- else %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}"
    "{%- if loop.last and not add_generation_prompt %}<|return|>{%- else %}<|end|>{%- endif %}"
    "{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- set result = namespace(call=none) %}"
    "{%- for call in ns.pending if result.call is none and (call[0] == message.get('tool_call_id') or "
    "call[1] == message.get('name')) %}"
    "{%- set result.call = call %}"
    "{%- endfor %}"
    "{%- set result.call = result.call or ns.pending|first %}"
    "{%- if result.call is not defined or result.call is none %}"
    "{{- raise_exception('a tool message must answer a call of an earlier assistant message with tool_calls') }}"
    "{%- endif %}"
    "{%- set ns.pending = ns.pending|reject('sameas', result.call)|list %}"
    "<|start|>functions.{{ result.call[1] }} to=assistant<|channel|>commentary<|message|>{{ message['content'] }}<|end|>"
    "{%- else %}"
    "{{- raise_exception('harmony messages take roles system, developer, user, assistant, tool; got '"
    " + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
