"""The OpenAI wire protocol, chat's own fields: `messages` (roles, content parts, tool calls and
tool results), `tools`, `chat_template_kwargs` and `role_mapping`, validated into what the chat
template is given (openai_wire.py parses the rest of a chat request; app.py renders the template).

As clients send them: content a string, a list of text parts (joined), or null on an assistant
message with `tool_calls`; images, audio and other parts are a 400 (gmlx serves text).
"""

from __future__ import annotations

import json

from gmlx.serve.api_error import bad, show

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# keys a message may carry besides role and content, per role (anything else non-null is a 400)
_MESSAGE_KEYS = {"assistant": {"name", "tool_calls"}, "tool": {"name", "tool_call_id"}}
# chat_template_kwargs may not override how gmlx calls the template
_TEMPLATE_RESERVED = {"conversation", "messages", "tools", "tokenize", "return_dict", "add_generation_prompt",
                      "continue_final_message", "return_tensors"}


def parse_tools(tools) -> list | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("`tools` must be a list of tool objects ({\"type\": \"function\", \"function\": {...}})", "tools")
    return tools


def parse_template_kwargs(kw) -> dict:
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise bad(f"`chat_template_kwargs` must be an object, got {show(kw)}", "chat_template_kwargs")
    reserved = sorted(set(kw) & _TEMPLATE_RESERVED)
    if reserved:
        raise bad(f"`chat_template_kwargs.{reserved[0]}` is set by gmlx and cannot be overridden",
                  f"chat_template_kwargs.{reserved[0]}")
    return dict(kw)


def parse_role_mapping(rm) -> dict | None:
    if rm is None:
        return None
    if not isinstance(rm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rm.items()):
        raise bad("`role_mapping` must be an object of strings (mlx_lm.server's role prefixes)", "role_mapping")
    return rm


def parse_messages(msgs) -> list[dict]:
    """Messages for the chat template, as clients send them: content a string, a list of text
    parts (joined), or null on an assistant message with `tool_calls`; `tool` messages with their
    `tool_call_id`. Tool-call arguments given as a JSON string are parsed to an object (what
    chat templates expect, as mlx_lm.server does). Images, audio and other parts are a 400."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("`messages` must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"`{where}` must be an object with `role` and `content`", where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"`{where}.role` must be one of system, developer, user, assistant, tool, got {show(role)}",
                      f"{where}.role")
        role = _ROLES[role]
        allowed = _MESSAGE_KEYS.get(role, {"name"})
        for k, v in m.items():
            if k not in ("role", "content") and k not in allowed and v is not None:
                raise bad(f"`{where}.{k}` is not supported by gmlx", f"{where}.{k}", "unsupported_parameter")
        msg = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, where)
        content = m.get("content")
        msg["content"] = "" if content is None and calls else _content(content, where)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"`{where}.tool_call_id` must be a string (the id of the call it answers)",
                          f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"`{where}.tool_calls` must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"`{w}` must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                      f"{where}.tool_calls")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"`{w}.function.arguments` is not valid JSON", f"{where}.tool_calls") from None
        out.append({**c, "function": {**fn, "arguments": args if args is not None else {}}})
    return out


def _content(c, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c:
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"`{where}.content[{j}]` must be a text part ({{\"type\": \"text\", \"text\": ...}});"
                          " gmlx serves text only", f"{where}.content[{j}]", "unsupported_parameter")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"`{where}.content` must be a string or a list of text parts", f"{where}.content")
