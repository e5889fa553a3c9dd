"""Chat templates and tool-call formats for the agent loop.

Two ways for a model to call a tool:

- "qwen": the tokenizer's own chat template renders the tools (Qwen3 / Qwen3.5 style). The model writes
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen3) or
  `<tool_call><function=name><parameter=key>value</parameter></function></tool_call>` (Qwen3.5); results go
  back through the template as role "tool" messages.
- "tags": for templates that ignore tools, or no template at all. The tools are described in the system
  prompt; the model writes `<python>code</python>` or `<search>query</search>` (the tag is the tool's name,
  the body its main argument) and the result is appended in the same turn as `<result>...</result>`.

"auto" picks "qwen" when the template demonstrably renders a tools block and tool responses, else "tags".
Parsing never raises: a malformed call becomes a `ParsedCall` with an error the model gets to read (short, and
quoting at most a clipped name of what the model wrote). Every string decoded from a call is valid Unicode (a
JSON `"\ud800"` escape decodes to U+FFFD), and so is every observation before a tokenizer sees it.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from copes.choices import TOOL_FORMATS
from copes.text import valid_unicode
from copes.tools import Tool, tool_schema

QWEN_CALL_OPEN, QWEN_CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

# Marker strings used to probe a chat template; they never reach a model.
_PROBE_TOOL = "copes_probe_tool"
_ASSISTANT_MARKER = "COPES_ASSISTANT_MARKER"
_OBSERVATION_MARKER = "COPES_OBSERVATION_MARKER"

Message = Mapping[str, Any]

# Inserted after the first character of every markup string found in untrusted text: invisible when read, but the
# tokenizer no longer matches the string, so it stays plain text instead of becoming a special token.
_MARKUP_BREAK = "\u200b"
_MARKUP_PATTERNS: weakref.WeakKeyDictionary[Any, tuple[int, re.Pattern[str] | None]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in model output; `error` is None exactly when it is well-formed and known."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None


def _render(tokenizer: Any, messages: Sequence[Message], template_kwargs: Mapping[str, Any], **options: Any) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, **options, **template_kwargs)


def template_supports_tools(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> bool:
    """True when the chat template renders a tools block with the `<tool_call>` convention and tool results."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    probe = {
        "type": "function",
        "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {"type": "object", "properties": {}}},
    }
    kwargs = dict(template_kwargs or {})
    try:
        with_tools = _render(
            tokenizer, [{"role": "user", "content": "q"}], kwargs, tools=[probe], add_generation_prompt=True
        )
        results = tool_results_suffix(tokenizer, [_OBSERVATION_MARKER], kwargs)
    except (TemplateError, ValueError, TypeError):
        # Templates reject what they do not know in many ways (raise_exception, missing keys, role checks).
        return False
    return _PROBE_TOOL in with_tools and QWEN_CALL_OPEN in with_tools and _OBSERVATION_MARKER in results


def resolve_tool_format(
    tokenizer: Any, tool_format: str = "auto", template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """Turn "auto" into "qwen" or "tags"; reject "qwen" for a template that cannot render tools."""
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    if tool_format == "tags":
        return "tags"
    supported = template_supports_tools(tokenizer, template_kwargs)
    if tool_format == "qwen" and not supported:
        raise ValueError(
            "tool_format='qwen' needs a chat template that renders tools and tool results; use 'tags' or 'auto'"
        )
    return "qwen" if supported else "tags"


def _main_parameter(tool: Tool) -> str | None:
    """The argument a tag body fills: the first required parameter, else the first declared one."""
    required = tool.parameters.get("required") or []
    if required:
        return required[0]
    return next(iter(tool.parameters.get("properties") or {}), None)


def tag_format_instructions(tools: Sequence[Tool]) -> str:
    header = (
        "You can use the following tools. To call one, write its input between its tags; the result is returned "
        f"between {RESULT_OPEN} and {RESULT_CLOSE}."
    )
    lines = [header]
    for tool in tools:
        if _takes_several_arguments(tool):  # the whole arguments object, and its schema (TRL offers the schema too)
            example = ", ".join(f'"{name}": ...' for name in tool.parameters["properties"])
            lines.append(f"- <{tool.name}>{{{example}}}</{tool.name}>: {tool.description} The input is a JSON "
                         f"object; its schema: {json.dumps(tool.parameters)}")
        else:
            argument = _main_parameter(tool) or "input"
            lines.append(f"- <{tool.name}>{argument}</{tool.name}>: {tool.description}")
    return "\n".join(lines)


def _takes_several_arguments(tool: Tool) -> bool:
    """A tag body fills one argument; a tool with several takes a JSON object of them instead."""
    return len(tool.parameters.get("properties") or {}) > 1


def _tag_call(name: str, body: str, tool: Tool) -> ParsedCall:
    """The call a `<name>body</name>` block makes: the body is the one argument, or the JSON arguments object (or,
    for a tool with one required argument among optional ones, that argument)."""
    if not _takes_several_arguments(tool):
        parameter = _main_parameter(tool)
        return _check_required(name, {parameter: body.strip("\n")} if parameter else {}, tool)
    arguments, error = _load_json(body)
    if not error and isinstance(arguments, dict):
        return _check_required(name, arguments, tool)
    required = tool.parameters.get("required") or []
    if len(required) == 1:  # a plain body still fills the one required argument; the optional ones keep defaults
        return _check_required(name, {required[0]: body.strip("\n")}, tool)
    return ParsedCall(name, error=f"the <{name}> block must hold a JSON object of its arguments "
                                  f"({', '.join(tool.parameters['properties'])})")


def _with_tag_instructions(messages: Sequence[Message], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    instructions = tag_format_instructions(tools)
    messages = [dict(message) for message in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
        return messages
    return [{"role": "system", "content": instructions}, *messages]


def _render_plain(messages: Sequence[Message]) -> str:
    """Role-labelled text for tokenizers without a chat template."""
    turns = [
        message["content"] if message["role"] == "system" else f"{message['role'].capitalize()}: {message['content']}"
        for message in messages
    ]
    return "\n\n".join([*turns, "Assistant:"])


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[Tool] | None = None,
    *,
    tool_format: str = "auto",
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` ending in an open assistant turn, with `tools` offered in the chosen format.

    `template_kwargs` reach the chat template (e.g. `{"enable_thinking": False}` for Qwen3).
    """
    tools = list(tools or ())
    fmt = resolve_tool_format(tokenizer, tool_format, template_kwargs) if tools else None
    return render_prompt_in_format(tokenizer, messages, tools, fmt, template_kwargs)


def render_prompt_in_format(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[Tool],
    fmt: str | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """`render_prompt` with the format already resolved (`fmt` from `resolve_tool_format`, None without tools),
    so a rollout over thousands of rows probes the template once, not once per row."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    if fmt == "tags":
        messages = _with_tag_instructions(messages, tools)
    if getattr(tokenizer, "chat_template", None) is None:
        return _render_plain(messages)
    schemas = [tool_schema(tool) for tool in tools] if fmt == "qwen" else None
    return _render(tokenizer, messages, template_kwargs or {}, tools=schemas, add_generation_prompt=True)


def tool_stop_strings(fmt: str, tools: Sequence[Tool]) -> tuple[str, ...]:
    """Where a turn that calls a tool must stop so the call can run before the model continues."""
    if fmt == "qwen":
        return (QWEN_CALL_CLOSE,)
    if fmt == "tags":
        return tuple(f"</{tool.name}>" for tool in tools)
    raise ValueError(f"fmt must be 'qwen' or 'tags', got {fmt!r}")


def tool_results_suffix(
    tokenizer: Any, observations: Sequence[str], template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """Text that closes an assistant turn which stopped after a tool call, adds the results as role "tool"
    messages and opens the next assistant turn, exactly as the chat template renders them.

    Rendered by difference: a conversation whose assistant turn is a marker, followed by the tool messages;
    everything after the marker is the suffix. This keeps each template's own glue (end-of-turn token, the
    user-turn wrapping of tool responses, a thinking preamble in the generation prompt).
    """
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": _ASSISTANT_MARKER},
        *({"role": "tool", "content": observation} for observation in observations),
    ]
    rendered = _render(tokenizer, messages, template_kwargs or {}, add_generation_prompt=True)
    if _ASSISTANT_MARKER not in rendered:
        raise ValueError("the chat template does not render assistant content verbatim; use tool_format='tags'")
    # Templates may trim or wrap the observations, so they are not checked here; `template_supports_tools`
    # already checked that role "tool" content reaches the prompt.
    return rendered.split(_ASSISTANT_MARKER, 1)[1]


def _markup_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """One alternation of every string the tokenizer turns into an added token (special or not: `<|im_end|>` as
    much as `</tool_response>`), plus the tag format's result tags; longest first, so overlaps break the longer."""
    cached = _MARKUP_PATTERNS.get(tokenizer)
    if cached is not None and cached[0] == len(tokenizer):  # the vocabulary grows when tokens are added
        return cached[1]
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings = {token.content for token in added.values()} | set(getattr(tokenizer, "all_special_tokens", []))
    strings |= {RESULT_OPEN, RESULT_CLOSE}
    strings = sorted((string for string in strings if len(string) > 1), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
    _MARKUP_PATTERNS[tokenizer] = (len(tokenizer), pattern)
    return pattern


def neutralize_markup(tokenizer: Any, text: str) -> str:
    """`text` with every chat-markup string broken (see `_MARKUP_BREAK`), so a tool that prints
    `<|im_end|><|im_start|>user` cannot forge a turn when the transcript is tokenized again."""
    pattern = _markup_pattern(tokenizer)
    if pattern is None:
        return text
    return pattern.sub(lambda match: match[0][0] + _MARKUP_BREAK + match[0][1:], text)


def _decode_observation(tokenizer: Any, ids: list[int]) -> str:
    # With the markup broken, a special token here is a tokenizer's unknown token (whose text may be
    # `<|endoftext|>`): decoding it as text would write the special string back into the context.
    return tokenizer.decode(ids, skip_special_tokens=True)


def observation_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """Untrusted tool output as it enters the context: valid Unicode, markup neutralized, clipped to `max_tokens`
    tokens (keeping both ends: a program's first lines say what it did, its last lines hold the result). Output
    that is not text at all (a custom tool returning None) becomes an error observation."""
    if not isinstance(text, str):
        text = f"Error: the tool returned {type(text).__name__}, not text."
    text = valid_unicode(text)
    # Only a bounded prefix and suffix are ever tokenized, so a 20 MB passage costs what a short one does.
    window = 16 * max_tokens
    clipped_chars = len(text) > 2 * window
    if clipped_chars:
        text = text[:window] + text[-window:]
    ids = tokenizer.encode(neutralize_markup(tokenizer, text), add_special_tokens=False)
    decode = functools.partial(_decode_observation, tokenizer)
    if len(ids) <= max_tokens and not clipped_chars:
        return decode(ids)
    note = f"\n... [{'some' if clipped_chars else len(ids) - max_tokens} tokens omitted] ...\n"
    half = (max_tokens - len(tokenizer.encode(note, add_special_tokens=False))) // 2
    while half > 0:
        # Decoding a slice and encoding it again can merge differently; shrink until the whole fits.
        clipped = decode(ids[:half]) + note + decode(ids[-half:])
        excess = len(tokenizer.encode(clipped, add_special_tokens=False)) - max_tokens
        if excess <= 0:
            return clipped
        half -= excess
    return decode(ids[:max_tokens])  # a budget too small for the note


def tag_results_suffix(observations: Sequence[str]) -> str:
    return "".join(f"\n{RESULT_OPEN}\n{observation}\n{RESULT_CLOSE}\n" for observation in observations)


def _tag_bodies(text: str, open_tag: str, close_tag: str) -> list[tuple[int, str | None]]:
    """(position, body) for every closing tag, in order; body None when no opening tag precedes it.

    An opening tag that is never closed is not a call (the turn was cut before the call was complete).
    """
    bodies: list[tuple[int, str | None]] = []
    position = 0
    while (end := text.find(close_tag, position)) != -1:
        start = text.rfind(open_tag, position, end)
        bodies.append((end, None if start == -1 else text[start + len(open_tag) : end]))
        position = end + len(close_tag)
    return bodies


def _valid_strings(value: Any) -> Any:
    """Decoded JSON with every string, keys included, made valid Unicode."""
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, list):
        return [_valid_strings(item) for item in value]
    if isinstance(value, dict):
        return {valid_unicode(key): _valid_strings(item) for key, item in value.items()}
    return value


def _load_json(text: str) -> tuple[Any, str | None]:
    """(value, None) with valid Unicode strings, or (None, why it is not JSON). Model output can nest brackets past
    the parser's recursion limit (RecursionError) or write an integer longer than Python converts (ValueError)."""
    try:
        return _valid_strings(json.loads(text)), None
    except json.JSONDecodeError as error:
        return None, f"{error.msg} at position {error.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError:
        return None, "a number in it has too many digits"


def _coerce(value: str, schema: Mapping[str, Any]) -> Any:
    """A Qwen3.5 `<parameter>` value is untyped text; the tool's JSON schema says what it means."""
    if schema.get("type") in ("integer", "number", "boolean", "object", "array", "null"):
        decoded, error = _load_json(value)
        return value if error else decoded
    return value


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_XML_FUNCTION_CLOSE = "</function>"
_XML_PARAMETER_OPEN, _XML_PARAMETER_CLOSE = "<parameter=", "</parameter>"


def _xml_parameters(text: str) -> list[tuple[str, str]]:
    """(name, value) of every `<parameter=name>value</parameter>`, left to right, in linear time: a plain scan
    with str.find, because a regex retries from every unclosed `<parameter=` (quadratic on hostile output)."""
    found = []
    position = 0
    while (start := text.find(_XML_PARAMETER_OPEN, position)) != -1:
        name_start = start + len(_XML_PARAMETER_OPEN)
        name_end = text.find(">", name_start)
        newline = text.find("\n", name_start, name_end) if name_end != -1 else -1
        if name_end in (-1, name_start) or newline != -1:
            position = name_start  # not a parameter tag; the next one may be
            continue
        close = text.find(_XML_PARAMETER_CLOSE, name_end + 1)
        if close == -1:
            break  # no parameter after this one can close either
        found.append((text[name_start:name_end], text[name_end + 1 : close]))
        position = close + len(_XML_PARAMETER_CLOSE)
    return found


def _parse_qwen_body(body: str, tools: Mapping[str, Tool]) -> ParsedCall:
    body = body.strip()
    if body.startswith("<function="):
        match = _XML_FUNCTION.match(body)
        name = match.group(1).strip() if match else None
        if name not in tools:
            return _unknown_tool(name, tools)
        properties = tools[name].parameters.get("properties") or {}
        function_end = body.find(_XML_FUNCTION_CLOSE, match.end())
        function_body = body[match.end() : None if function_end == -1 else function_end]
        arguments = {
            key.strip(): _coerce(value.strip("\n"), properties.get(key.strip(), {}))
            for key, value in _xml_parameters(function_body)
        }
        return _check_required(name, arguments, tools[name])
    payload, error = _load_json(body)
    if error:
        return ParsedCall(None, error=f"the tool call is not valid JSON ({error})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ParsedCall(None, error='the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = payload["name"]
    if name not in tools:
        return _unknown_tool(name, tools)
    if "arguments" not in payload:
        return ParsedCall(name, error=f"the call to {name!r} has no 'arguments' object")
    arguments = payload["arguments"]
    if isinstance(arguments, str):  # some models emit the arguments object JSON-encoded a second time
        decoded, error = _load_json(arguments)
        arguments = arguments if error else decoded
    if not isinstance(arguments, dict):
        return ParsedCall(name, error=f"the 'arguments' of {name!r} must be a JSON object")
    return _check_required(name, arguments, tools[name])


_MAX_QUOTED_NAME_CHARS = 60  # an error quotes this much of an unknown tool name, never the whole of it


def _unknown_tool(name: str | None, tools: Mapping[str, Tool]) -> ParsedCall:
    shown = name if name is None or len(name) <= _MAX_QUOTED_NAME_CHARS else name[:_MAX_QUOTED_NAME_CHARS] + "..."
    return ParsedCall(name, error=f"unknown tool {shown!r}; available: {', '.join(tools) or 'none'}")


def _check_required(name: str, arguments: dict[str, Any], tool: Tool) -> ParsedCall:
    missing = [key for key in tool.parameters.get("required") or [] if key not in arguments]
    if missing:
        return ParsedCall(
            name, arguments, error=f"the call to {name!r} is missing required argument(s): {', '.join(missing)}"
        )
    return ParsedCall(name, arguments)


def parse_tool_calls(text: str, fmt: str, tools: Sequence[Tool]) -> list[ParsedCall]:
    """Every complete tool call in `text`, in order; malformed or unknown calls come back invalid, never raised."""
    by_name = {tool.name: tool for tool in tools}
    if fmt == "qwen":
        return [
            ParsedCall(None, error=f"found {QWEN_CALL_CLOSE} without a matching {QWEN_CALL_OPEN}")
            if body is None
            else _parse_qwen_body(body, by_name)
            for _, body in _tag_bodies(text, QWEN_CALL_OPEN, QWEN_CALL_CLOSE)
        ]
    if fmt != "tags":
        raise ValueError(f"fmt must be 'qwen' or 'tags', got {fmt!r}")
    found: list[tuple[int, ParsedCall]] = []
    for name, tool in by_name.items():
        for position, body in _tag_bodies(text, f"<{name}>", f"</{name}>"):
            if body is None:
                call = ParsedCall(name, error=f"found </{name}> without a matching <{name}>")
            elif not body.strip():
                call = ParsedCall(name, error=f"the <{name}> block is empty")
            else:
                call = _tag_call(name, body, tool)
            found.append((position, call))
    return [call for _, call in sorted(found, key=lambda item: item[0])]
