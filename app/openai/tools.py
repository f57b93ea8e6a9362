"""Function tools on a chat: `tools` and `tool_choice` checked into the functions the chat
template renders, an assistant's calls and the tools' results in the messages checked into the
shape chat templates take them, and a reply's calls in OpenAI's shape, whole or streamed.

Only a model that speaks harmony (gpt-oss) and whose chat template renders tools takes them:
its calls are read back from its reply (`specpipe.transformer.harmony`). Messages go to the
template as transformers' chat templates take them: an assistant's call with its arguments as
an object (the JSON text as written where it is not one), its reasoning as `thinking`, a tool's
result with the `name` of the function that gave it.
"""

from __future__ import annotations

import json
import re
import secrets

from app.openai.errors import OpenAIError
from specpipe.decoding.target import Target
from specpipe.transformer.harmony import ToolCall

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
CHOICES = ("auto", "none")  # the `tool_choice` words honoured; "required" is refused


def takes_tools(target: Target | None) -> bool:
    """Whether the model's chat template renders tools and its replies' calls can be read."""
    return target is not None and target.harmony and target.takes_tools


def refuse_tools(param: str) -> OpenAIError:
    """The 400 for tools (or a chat that used them) sent to a model that does not take them."""
    return OpenAIError(
        400,
        "tools are not supported by this model: they need a model that speaks harmony "
        "(gpt-oss) with a chat template that renders them",
        param=param,
    )


def _bad(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{param} {what}", param=param)


def check_tools(tools: object) -> list[dict]:
    """The request's `tools` as the chat template takes them; [] for none."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of function tools")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        function = _check_tool(tool, f"tools[{i}]")
        if function["name"] in names:
            raise _bad(f"tools[{i}].function.name", f"repeats {function['name']!r}")
        names.add(function["name"])
        checked.append({"type": "function", "function": function})
    return checked


def _check_tool(tool: object, param: str) -> dict:
    """One tool's function: its name, description (empty when none) and parameters."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"{param}.type", 'must be "function": only function tools are supported')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{param}.function", "must be an object with the function's name")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"{param}.function.name", "must be 1 to 64 letters, digits, _ or -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.function.description", "must be text")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{param}.function.strict", "must be true or false")
    checked = {"name": name, "description": description or ""}
    parameters = function.get("parameters")
    if parameters is not None:
        checked["parameters"] = _check_parameters(parameters, f"{param}.function.parameters")
    return checked


def _check_parameters(schema: object, param: str) -> dict:
    """A JSON Schema of an object, as far as a template reads it: its properties, each a
    schema, and the names of those required."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise _bad(param, "must be a JSON Schema of an object")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
        isinstance(spec, dict) for spec in properties.values()
    ):
        raise _bad(param, "must give each property a schema (properties: an object of objects)")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _bad(param, "must list the required properties' names (required: a list of text)")
    return schema


def check_tool_choice(choice: object, tools: list[dict]) -> str | None:
    """The name of the one function `tool_choice` offers; None for `auto` (every tool) and
    `none` (no tool), told apart by the caller (`offered`)."""
    if choice is None or choice in CHOICES:
        return None
    if choice == "required":
        raise _bad(
            "tool_choice",
            '"required" is not supported: this server cannot make the model call a function; '
            'use "auto", "none" or a named function',
        )
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise _bad(
            "tool_choice",
            'must be "auto", "none", or {"type": "function", "function": {"name": ...}}',
        )
    name = function["name"]
    if name not in {tool["function"]["name"] for tool in tools}:
        raise _bad("tool_choice", f"names {name!r}, which is not among the tools")
    return name


def offered(tools: list[dict], choice: object) -> list[dict]:
    """The tools rendered into the prompt, as `tool_choice` says: every one (`auto`), none
    (`none`), or only the function it names."""
    name = check_tool_choice(choice, tools)
    if choice == "none":
        return []
    if name is not None:
        return [tool for tool in tools if tool["function"]["name"] == name]
    return tools


def assistant_calls(message: dict, param: str, calls: dict[str, str]) -> dict:
    """What an assistant's message adds for the template: its `tool_calls` (noting each call's
    id and function in `calls`) and its reasoning (`reasoning_content`) as `thinking`."""
    extra: dict = {}
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise _bad(f"{param}.reasoning_content", "must be text")
        extra["thinking"] = reasoning
    tool_calls = message.get("tool_calls")
    if tool_calls is None or tool_calls == []:
        return extra
    if not isinstance(tool_calls, list):
        raise _bad(f"{param}.tool_calls", "must be a list of function calls")
    extra["tool_calls"] = [
        _check_call(call, f"{param}.tool_calls[{j}]", calls) for j, call in enumerate(tool_calls)
    ]
    return extra


def _check_call(call: object, param: str, calls: dict[str, str]) -> dict:
    """One call of an assistant's message, its arguments an object where they are JSON of one."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise _bad(param, 'must be a call of type "function"')
    call_id, function = call.get("id"), call.get("function")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{param}.id", "must be the call's id")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(f"{param}.function", "must be an object with the function's name")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        raise _bad(f"{param}.function.arguments", "must be the arguments' JSON text")
    calls[call_id] = function["name"]
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(arguments)},
    }


def _arguments(text: str) -> dict | str:
    """Arguments as templates take them: an object, or the text where it is not JSON of one."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def tool_result(message: dict, param: str, calls: dict[str, str]) -> dict:
    """What a tool's message adds for the template: the call it answers and its function."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{param}.tool_call_id", "must be the id of the call it answers")
    if call_id not in calls:
        raise _bad(f"{param}.tool_call_id", f"{call_id!r} is no earlier assistant's call")
    return {"tool_call_id": call_id, "name": calls[call_id]}


def call_text(call: dict) -> str:
    """A stored call as the job's readable transcript shows it: `name(arguments)`."""
    function = call["function"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"{function['name']}({arguments})"


def new_call_id() -> str:
    """A call's id in an answer, as OpenAI makes them: `call_` and random letters."""
    return "call_" + secrets.token_hex(12)


def answer_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """A whole answer's `message.tool_calls`."""
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


def call_deltas(before: tuple[ToolCall, ...], now: tuple[ToolCall, ...], ids: list[str]):
    """A stream's `delta.tool_calls` for what `now` adds to `before` (the calls sent so far,
    whose ids are `ids`, to which a new call's is added): a new call's id, type and name with
    its arguments so far, then each piece of arguments written since."""
    deltas = []
    for index, call in enumerate(now):
        if index >= len(before):
            ids.append(new_call_id())
            function = {"name": call.name, "arguments": call.arguments}
            deltas.append(
                {"index": index, "id": ids[index], "type": "function", "function": function}
            )
            continue
        sent = before[index].arguments
        if len(call.arguments) > len(sent):
            more = call.arguments[len(sent) :]
            deltas.append({"index": index, "function": {"arguments": more}})
    return deltas
