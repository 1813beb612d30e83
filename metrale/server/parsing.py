"""Chat output parsing: reasoning (`<think>...</think>`) and Hermes/Qwen tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), incrementally.

`ChatOutputParser.feed(text)` returns events as soon as they are certain; text that could be
the start of a tag is held back until the next piece decides it. A tool call is emitted whole,
when its closing tag arrives; a span whose JSON does not parse is returned as content, as is.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str                 # a JSON text, as the OpenAI API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_tool_call(text: str) -> ToolCall | None:
    """The JSON inside one <tool_call> span, or None if it is not a call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], args)


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ChatOutputParser:
    """Splits generated text into ("reasoning", str), ("content", str) and ("tool_call", ToolCall)."""

    def __init__(self, *, reasoning: bool = True, tools: bool = False, in_reasoning: bool = False):
        self.reasoning, self.tools = reasoning, tools
        self.state = "reasoning" if (reasoning and in_reasoning) else "content"
        self.buf = ""
        self.lstrip = False          # drop the newlines that follow </think> or </tool_call>

    def _opening_tags(self) -> tuple[str, ...]:
        return ((THINK_OPEN,) if self.reasoning else ()) + ((CALL_OPEN,) if self.tools else ())

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        events: list[tuple[str, object]] = []
        while self.buf:
            if self.state == "content":
                tags = self._opening_tags()
                hits = [(self.buf.find(t), t) for t in tags if t in self.buf]
                if hits:
                    idx, tag = min(hits)
                    self._content(events, self.buf[:idx])
                    self.buf = self.buf[idx + len(tag):]
                    self.state = "reasoning" if tag == THINK_OPEN else "call"
                    continue
                keep = _partial_tag_len(self.buf, tags)
                self._content(events, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.state == "reasoning":
                idx = self.buf.find(THINK_CLOSE)
                if idx >= 0:
                    if idx:
                        events.append(("reasoning", self.buf[:idx]))
                    self.buf = self.buf[idx + len(THINK_CLOSE):]
                    self.state, self.lstrip = "content", True
                    continue
                keep = _partial_tag_len(self.buf, (THINK_CLOSE,))
                if len(self.buf) > keep:
                    events.append(("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            # state == "call": a call is emitted whole, when it closes
            idx = self.buf.find(CALL_CLOSE)
            if idx < 0:
                break
            self._call(events, self.buf[:idx], closed=True)
            self.buf = self.buf[idx + len(CALL_CLOSE):]
            self.state, self.lstrip = "content", True
        return events

    def finish(self) -> list[tuple[str, object]]:
        """Flushes what is held back at the end of the output (an unclosed span included)."""
        events: list[tuple[str, object]] = []
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            if rest:
                events.append(("reasoning", rest))
        elif self.state == "call":
            self._call(events, rest, closed=False)
        else:
            self._content(events, rest)
        self.state = "content"
        return events

    def _content(self, events: list, text: str) -> None:
        if self.lstrip:
            text = text.lstrip("\n")
            if text:
                self.lstrip = False
        if text:
            events.append(("content", text))

    def _call(self, events: list, inner: str, closed: bool) -> None:
        call = parse_tool_call(inner.strip())
        if call is not None:
            events.append(("tool_call", call))
        else:
            self._content(events, CALL_OPEN + inner + (CALL_CLOSE if closed else ""))


@dataclass
class ParsedChat:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[tuple[str, object]]) -> None:
        for kind, value in events:
            if kind == "content":
                self.content += value
            elif kind == "reasoning":
                self.reasoning += value
            else:
                self.tool_calls.append(value)


def parse_chat_output(text: str, *, reasoning: bool = True, tools: bool = False,
                      in_reasoning: bool = False) -> ParsedChat:
    parser = ChatOutputParser(reasoning=reasoning, tools=tools, in_reasoning=in_reasoning)
    out = ParsedChat()
    out.add(parser.feed(text))
    out.add(parser.finish())
    return out


# ------------------------------------------------------------------- tools in the prompt
TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_knows_tools(tokenizer) -> bool:
    """True when the model's chat template renders `tools` itself (Qwen, Hermes, Llama 3.1, ...)."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def inline_tools(messages: list[dict], tools: list[dict] | None, instruction: str | None = None) -> list[dict]:
    """For templates that know nothing of tools: the Hermes tool prompt goes into the system
    message, assistant tool calls become <tool_call> text, tool results become user turns."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(CALL_OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]},
                                                            ensure_ascii=False) + "\n" + CALL_CLOSE
                              for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).lstrip("\n")
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools:
        tools_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out = with_system_text(out, TOOLS_SYSTEM_PROMPT.format(tools=tools_text))
    return with_system_text(out, instruction)


def with_system_text(messages: list[dict], text: str | None) -> list[dict]:
    """messages with text appended to the system message (one is added first if there is none)."""
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": (messages[0].get("content") or "") + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages
