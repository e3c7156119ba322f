"""Chat requests on the wire: messages, tools, tool_choice and template kwargs, validated.

Owns the chat-only request fields and their checks, each error a 400 naming the field
(`messages[2].tool_calls[0]`, `tool_choice`, ...). What a validated request becomes (a
prompt, a parsed turn) is `pdflash.server.chat`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from pdflash.chat.families import AUTO, ToolChoice
from pdflash.chat.template import RESERVED_VARIABLES
from pdflash.server.errors import invalid

CHAT_FIELDS = {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "documents"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content", "reasoning", "thinking")


@attrs.frozen(kw_only=True)
class ChatRequest:
    """The chat part of a request, validated."""

    messages: list[dict[str, Any]]  # role, content as text, and tool_calls / tool_call_id / name / reasoning
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, as sent (the template renders them)
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)  # chat_template_kwargs, e.g. enable_thinking
    documents: list[dict[str, Any]] | None = None


def parse_chat_request(body: Mapping[str, Any]) -> ChatRequest:
    tools = parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"parallel_tool_calls must be a boolean, got {json.dumps(parallel)}", param="parallel_tool_calls")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid(
            f'chat_template_kwargs must be an object like {{"enable_thinking": false}}, got {json.dumps(kwargs)[:200]}',
            param="chat_template_kwargs",
        )
    reserved = sorted(RESERVED_VARIABLES & set(kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs cannot set {reserved[0]!r}: it comes from the request's own field",
            param=f"chat_template_kwargs.{reserved[0]}",
        )
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise invalid(f"documents must be an array of objects, got {json.dumps(documents)[:200]}", param="documents")
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=True if parallel is None else parallel,
        template_kwargs=kwargs,
        documents=documents,
    )


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise invalid(
            f"messages must be a non-empty array of {{role, content}} objects, got {json.dumps(value)[:200]}",
            param="messages",
        )
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise invalid(
            f"messages[{i}] must be an object with a role in {list(CHAT_ROLES)}, got {json.dumps(message)[:200]}",
            param=f"messages[{i}].role",
        )
    out: dict[str, Any] = {"role": message["role"]}
    if message.get("content") is not None:  # a null content is left out, as transformers leaves it out
        out["content"] = _content(message["content"], i)
    for name in MESSAGE_TEXT_FIELDS:
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise invalid(
                    f"messages[{i}].{name} must be a string, got {json.dumps(message[name])[:200]}",
                    param=f"messages[{i}].{name}",
                )
            out[name] = message[name]
    if message.get("tool_calls") is not None:
        if message["role"] != "assistant":
            raise invalid(
                f"messages[{i}] has tool_calls but role {message['role']!r}; only assistant messages carry tool calls",
                param=f"messages[{i}].tool_calls",
            )
        out["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(_array(message["tool_calls"], i))]
    return out


def _array(value: Any, i: int) -> list:
    if not isinstance(value, list):
        raise invalid(
            f"messages[{i}].tool_calls must be an array, got {json.dumps(value)[:200]}",
            param=f"messages[{i}].tool_calls",
        )
    return value


def _tool_call(call: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    ok = (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), (str, dict))
    )
    if not ok:
        raise invalid(
            f'{where} must be {{"id", "type": "function", "function": {{"name": string, "arguments": JSON text}}}}, '
            f"got {json.dumps(call)[:200]}",
            param=where,
        )
    return call


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or an array of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(
        f"messages[{i}].content must be a string or an array of text parts, got {json.dumps(content)[:200]}",
        param=f"messages[{i}].content",
    )


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid(f"tools must be an array of function tools, got {json.dumps(value)[:200]}", param="tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        ok = (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
            and isinstance(function.get("parameters", {}), dict)
        )
        if not ok:
            raise invalid(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": non-empty string, '
                f'"description": string, "parameters": JSON schema object}}}}, got {json.dumps(tool)[:200]}',
                param=f"tools[{i}]",
            )
    return value or None


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    names = [t["function"]["name"] for t in tools or []]
    if value is None:
        return AUTO if tools else ToolChoice(mode="none")
    if value in ("auto", "none", "required"):
        choice = ToolChoice(mode=value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = ToolChoice(mode="function", name=value["function"].get("name"))
        if choice.name not in names:
            raise invalid(
                f"tool_choice names the function {json.dumps(choice.name)}, which is not among the tools {names}",
                param="tool_choice",
            )
    else:
        raise invalid(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {json.dumps(value)[:200]}",
            param="tool_choice",
        )
    if choice.forced and not tools:
        raise invalid(f"tool_choice {json.dumps(value)} needs tools, and the request has none", param="tool_choice")
    return choice
