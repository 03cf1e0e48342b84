"""Qwen3.5 reasoning split: text before `</think>` is reasoning, text after it the answer.

Generation starts inside `<think>` when the prompt left it open (`reasoning_open_in_prompt`);
with thinking off all output is content. `<tool_call>` ends reasoning too, a `<think>` at the
very start of the output is stripped, and whitespace around the parts is trimmed, the same
way streamed and not.
"""

from __future__ import annotations

from tinyserve.server.tool_parser import TOOL_OPEN, partial_suffix_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def reasoning_open_in_prompt(prompt_text: str) -> bool:
    """True when the prompt ends inside an open `<think>` block."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class ReasoningParser:
    """Incremental splitter. `feed(text) -> (reasoning, content)`; `finish()` flushes."""

    def __init__(self, reasoning_open: bool) -> None:
        self._state = "start"  # start -> reasoning -> content
        self._open = reasoning_open
        self._buf = ""
        self._lstrip = True  # trim leading whitespace of the part now being written

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            before = (self._state, self._buf)
            if self._state == "start":
                self._step_start()
            elif self._state == "reasoning":
                reasoning.append(self._step_reasoning())
            else:
                content.append(self._step_content())
            if (self._state, self._buf) == before:
                return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return buf.rstrip(), ""
        if self._state == "start" and self._open:
            return buf.strip(), ""
        return "", buf

    def _step_start(self) -> None:
        head = self._buf.lstrip()
        if head.startswith(THINK_OPEN):
            self._buf = head[len(THINK_OPEN):]
            self._state = "reasoning"
        elif THINK_OPEN.startswith(head):
            return  # maybe a `<think>` still arriving (or only whitespace so far)
        else:
            self._state = "reasoning" if self._open else "content"
        self._lstrip = True

    def _at_text(self) -> bool:
        """Whether text is buffered, once the part's leading whitespace is dropped."""
        if self._lstrip:
            self._buf = self._buf.lstrip()
            self._lstrip = not self._buf
        return bool(self._buf)

    def _step_reasoning(self) -> str:
        if not self._at_text():
            return ""
        buf = self._buf
        ends = [(p, tag) for tag in (THINK_CLOSE, TOOL_OPEN) if (p := buf.find(tag)) >= 0]
        if ends:
            pos, tag = min(ends)
            out = buf[:pos].rstrip()
            self._buf = buf[pos + len(THINK_CLOSE):] if tag == THINK_CLOSE else buf[pos:]
            self._state = "content"
            self._lstrip = True
            return out
        keep = max(partial_suffix_len(buf, THINK_CLOSE), partial_suffix_len(buf, TOOL_OPEN))
        body = buf[: len(buf) - keep]
        out = body.rstrip()  # trailing whitespace waits: it is dropped before `</think>`
        self._buf = buf[len(out):]
        return out

    def _step_content(self) -> str:
        if not self._at_text():
            return ""
        out, self._buf = self._buf, ""
        return out
