"""A model's thinking, split out of its answer: the text between its think markers (`<think>`
and `</think>` for Qwen3, DeepSeek-R1 and most others; the markers mlx-lm's tokenizer wrapper
infers from the vocabulary where it knows others) becomes `Thinking` events, which each
dialect renders in its own place for reasoning (Anthropic's `thinking` blocks, the Responses
API's `reasoning` items, chat completions' `reasoning_content`), and the rest stays the answer.

A model has a thinking mode when mlx-lm infers think markers from its vocabulary, or its chat
template writes `<think>` or takes `enable_thinking`. A think block is recognized at the
answer's start only (after any whitespace), or from the first token when the prompt itself
ends inside one; a model that writes `<think>` in the middle of its answer is quoting it. What
the templates read for this (Qwen3, Qwen3-Thinking-2507, DeepSeek-R1 and its distills,
DeepSeek-V3.1, GLM-4.5, Olmo-3-Think, Phi-4-reasoning) ask of it:

- Opened in the prompt: Qwen3-Thinking's, R1's distills' and Olmo-3-Think's generation prompts
  end with `<think>` (the prompt's last 16 tokens are read for it). A model that writes the
  opening marker again anyway has it dropped (vLLM's and SGLang's R1 parsers accept both).
- Whitespace first: GLM-4.5 writes `\n<think>`; skipped.
- After a tool result in an agent loop, each turn is a new answer: Qwen3's and GLM's templates
  end the prompt at the assistant's role and the model's think block starts the answer; R1's
  and V3.1's add no generation prompt after a tool's output, so the answer is whatever the
  model writes there (a `<think>` first is a block; V3.1 calls tools without thinking).
- Mid-answer: no template above asks for a second block in one answer, and a coding agent
  asked to write this module writes `START, END = "<think>", "</think>"` in its answer: read
  as a block, that answer's code would come back as thinking, cut at the quoted `</think>`.

Read by text, not tokens: a `</think>` the model writes inside its thinking ends the block
there (llama-server does the same), and a tool result whose last few tokens hold an unclosed
`<think>` would open the answer's block.
"""

from __future__ import annotations

from dataclasses import dataclass

from .events import Text, Thinking

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Think:
    start: str
    end: str
    open: bool  # the prompt ends inside a think block: the answer begins with thinking


def markers(tokenizer) -> tuple[str, str] | None:
    """The model's think markers, or None when it has no thinking mode."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if START in template or "enable_thinking" in template:
        return START, END
    return None


def think_of(tokenizer, prompt_ids: list[int]) -> Think | None:
    """How this prompt's answer is read for thinking (None: the model has no thinking mode)."""
    m = markers(tokenizer)
    if m is None:
        return None
    tail = tokenizer.decode(prompt_ids[-16:])  # the generation prompt's end is enough
    return Think(m[0], m[1], tail.rfind(m[0]) > tail.rfind(m[1]))


class Splitter:
    """Streamed text in, `Thinking` and `Text` out. Text that may be the start of a marker is
    held back until the next piece decides; whitespace after the think block is dropped (the
    answer starts at its first word)."""

    def __init__(self, think: Think):
        self.t = think
        self.state = "inside" if think.open else "before"  # before | inside | after | answer
        self.buf = ""
        self.tokens = 0  # pieces fed while inside a think block: the reasoning tokens
        self.fresh = True  # no thinking written yet: leading whitespace is dropped

    @property
    def inside(self) -> bool:
        return self.state == "inside"

    def feed(self, text: str) -> list[Text | Thinking]:
        self.buf += text
        out: list[Text | Thinking] = []
        while True:
            if self.state == "before":
                head = self.buf.lstrip()
                if head.startswith(self.t.start):
                    self.buf, self.state = head[len(self.t.start) :], "inside"
                    continue
                if head and not self.t.start.startswith(head):
                    self.state = "answer"  # no think block: everything is the answer
                    continue
                return out  # nothing yet, or what may be the marker's start
            if self.state == "inside":
                if self.fresh:  # the model writing the opening marker the prompt wrote
                    head = self.buf.lstrip()
                    if head.startswith(self.t.start):
                        self.buf = head[len(self.t.start) :]
                        continue
                    if head and self.t.start.startswith(head):
                        return out  # what may be the marker's start
                j = self.buf.find(self.t.end)
                if j < 0:
                    keep = len(self.buf) - _partial_suffix(self.buf, self.t.end)
                    head, rest = self.buf[:keep], self.buf[keep:]
                    head = head.lstrip() if self.fresh else head
                    body = head.rstrip()
                    out += self._thought(body)
                    # trailing whitespace waits: it is dropped if the block ends after it
                    self.buf = head[len(body) :] + rest
                    return out
                out += self._thought(self.buf[:j])
                self.buf, self.state = self.buf[j + len(self.t.end) :], "after"
                continue
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "answer"
            if self.buf:
                out.append(Text(self.buf))
            self.buf = ""
            return out

    def _thought(self, text: str) -> list[Text | Thinking]:
        """`text` as thinking, without the block's leading and trailing whitespace."""
        body = (text.lstrip() if self.fresh else text).rstrip()
        if not body:
            return []
        self.fresh = False
        return [Thinking(body)]

    def flush(self) -> list[Text | Thinking]:
        """The answer's end: what was held back, as what it was (a think block cut short by
        max_tokens is thinking)."""
        buf, self.buf = self.buf, ""
        if not buf or self.state == "after":
            return []
        if self.state == "inside":
            return [Thinking(buf.lstrip() if self.fresh else buf)] if buf.strip() else []
        return [Text(buf)]


def _partial_suffix(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0
