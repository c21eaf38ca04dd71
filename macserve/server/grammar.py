"""Constrained decoding: llguidance's token mask as an mlx-lm logits processor.

A request's `response_format` (json_object / json_schema) or a forced tool call (tool_choice
"required" or a named function) becomes an llguidance grammar; `Constraint` masks every
token the grammar cannot take next, so any model, even the tiny demo one, only writes text
the grammar accepts.

A mask alone keeps every prefix valid but does not make the text end: a small model can stay
inside a string until max_tokens cuts it. So the constraint also watches the token budget.
`_close` finds a short way from the current state to a complete text (closing quotes and
brackets first, then the smallest values: llguidance says which tokens fit at each point).
Once that path plus a margin no longer fits in the tokens left, each token is drawn from the
masked distribution as usual but kept only if the text can still be finished after it within
the budget; otherwise the next step of the closing path is taken. The margin is the shortest
whole answer plus MARGIN tokens: one token can open at most about that much (a new array
item, another tool call), so the check starts before a free token could overshoot. The answer then always
parses, provided max_tokens leaves room for the shortest complete text.

JSON is written on one line (`{"a": 1, "b": [2, 3]}`): llguidance's flexible whitespace would
let a small model fill its budget with newlines. Objects with `properties` and no
`additionalProperties` get `additionalProperties: false`, as OpenAI's strict mode requires:
every answer still validates against the schema the client sent, and the closing path can
always name the properties still required.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from ..web.errors import HttpError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Tried in this order by the closing path: end what is open, then the shortest values; inside
# a string, the closing quote first, then any letter.
CLOSERS = ["}", "]", "0", '"', ":", ",", "[", "{", "n", "t", "f", "-"]
IN_STRING = ['"', "a"]
CLOSE_CAP = 256  # tokens the closing path may take before it is called unreachable
MARGIN = 16  # headroom (beyond the shortest whole answer) below which tokens are checked
RESAMPLES = 3  # draws tried before falling back to the closing path


def strict_schema(schema):
    """A copy of `schema` where every object that lists properties and says nothing about
    others gets additionalProperties: false (a narrowing: what matches it matches the
    original)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (
        isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and "patternProperties" not in schema
        and "unevaluatedProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


def json_grammar(schema: dict) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            strict_schema(schema), overrides=JSON_OPTIONS
        )
    except ValueError as e:
        raise HttpError(400, f"invalid JSON schema: {e}", "response_format") from None


def lark_json(schema: dict) -> str:
    """A JSON schema as a Lark `%json` block, with the same one-line options."""
    body = dict(strict_schema(schema))
    body["x-guidance"] = JSON_OPTIONS
    return "%json " + json.dumps(body)


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Vocab:
    """What the constraints of one model share: llguidance's view of its tokenizer (built once,
    on first use) and the single-character tokens the closing path prefers."""

    def __init__(self, bundle):
        self.bundle = bundle
        self._tok = None
        self._lock = threading.Lock()  # request threads and the worker may ask at once
        self.closers: list[int] = []
        self.in_string: list[int] = []

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None:
                self._build()
            return self._tok

    def _build(self) -> None:
        b = self.bundle
        n_vocab = b.config.get("vocab_size")
        tok = llguidance.hf.from_tokenizer(
            b.tokenizer._tokenizer, n_vocab=n_vocab, eos_token=sorted(b.eos_ids)
        )
        self.n_vocab = n_vocab or tok.vocab_size
        # Bytes per token: where no closer fits (a property name, an enum value), the closing
        # path takes the longest allowed token, so it spells "genre" in one token, not five.
        self.lengths = np.zeros(self.n_vocab, dtype=np.int32)
        for i in range(min(self.n_vocab, tok.vocab_size)):
            self.lengths[i] = len(tok.decode_bytes([i]))
        for chars, ids in ((CLOSERS, self.closers), (IN_STRING, self.in_string)):
            for c in chars:
                enc = b.tokenizer.encode(c, add_special_tokens=False)
                if len(enc) == 1:
                    ids.append(enc[0])
        self._tok = tok

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def matcher(self, grammar: str, param: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise HttpError(400, f"cannot constrain the output: {m.get_error()}", param)
        return m


@dataclass(frozen=True)
class ConstraintSpec:
    """Everything a rank needs to build the same constraint (picklable: under mlx.launch the
    other ranks must mask and sample exactly as rank 0 does)."""

    grammar: str
    param: str  # the request field it came from, for error messages
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0

    def build(self, vocab: Vocab) -> Constraint:
        return Constraint(self, vocab, vocab.matcher(self.grammar, self.param))


class Constraint:
    """mlx-lm logits processor: f(tokens so far, logits) -> logits with the disallowed tokens
    at -inf. Called once per generated token, first with the prompt alone."""

    def __init__(self, spec: ConstraintSpec, vocab: Vocab, matcher: llguidance.LLMatcher):
        self.spec, self.vocab, self.m = spec, vocab, matcher
        self.seen: int | None = None
        self.generated = 0
        self.eos = sorted(vocab.bundle.eos_ids)
        self.sampler = make_sampler(spec.temperature, spec.top_p, top_k=spec.top_k)
        self.path_len = 0  # last known length of the closing path
        self.margin: int | None = None  # the shortest whole answer + MARGIN, set on first call
        self.quote = (False, False)  # (inside a JSON string, after a backslash) at the text's end

    def _scan(self, state: tuple[bool, bool], token: int) -> tuple[bool, bool]:
        """Whether the text is inside a JSON string after `token` (the closing path's choice of
        quote or bracket depends on it)."""
        inside, esc = state
        for ch in self.vocab.token_bytes(token):
            if esc:
                esc = False
            elif inside and ch == 0x5C:  # backslash
                esc = True
            elif ch == 0x22:  # double quote
                inside = not inside
        return inside, esc

    def _allowed(self, m: llguidance.LLMatcher) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(self.vocab.n_vocab, dtype=bool)
        n = min(len(bits), self.vocab.n_vocab)
        out[:n] = bits[:n].astype(bool)
        return out

    def _close(self, m: llguidance.LLMatcher) -> list[int] | None:
        """A short token path from m's state to an accepted text, ending with EOS; None when
        none is found within CLOSE_CAP tokens."""
        c, path, state = m.deep_copy(), [], self.quote
        for _ in range(CLOSE_CAP):
            if c.is_accepting():
                return path + [self.eos[0]]
            allowed = self._allowed(c)
            prefer = self.vocab.in_string if state[0] else self.vocab.closers
            t = next((i for i in prefer if allowed[i]), None)
            if t is None:
                ff = c.compute_ff_tokens()
                if ff:
                    t = ff[0]
                elif allowed.any():
                    t = int(np.argmax(np.where(allowed, self.vocab.lengths, -1)))
                else:
                    return None
            if not c.consume_token(t):
                return None
            path.append(t)
            state = self._scan(state, t)
        return None

    def _fits(self, token: int, remaining: int) -> bool:
        if token in self.eos:
            return True
        c = self.m.deep_copy()
        if not c.consume_token(token):
            return False
        saved, self.quote = self.quote, self._scan(self.quote, token)
        try:
            p = self._close(c)
        finally:
            self.quote = saved
        return p is not None and 1 + len(p) <= remaining

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.size
        if self.seen is None:
            self.seen = n  # the prompt: nothing to consume yet
        else:
            for t in tokens[self.seen :].tolist():
                self.m.consume_token(int(t))
                self.quote = self._scan(self.quote, int(t))
                self.generated += 1
            self.seen = n
        if self.m.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.m.get_error()}")
        allowed = self._allowed(self.m)
        if self.margin is None:
            whole = self._close(self.m)
            self.margin = (len(whole) if whole else 0) + MARGIN
        remaining = self.spec.max_tokens - self.generated  # tokens left, this one included
        # The closing path is measured every token once the budget is within reach of it,
        # every 8 tokens before that.
        if remaining <= 2 * (self.path_len + self.margin) or self.generated % 8 == 0:
            path = self._close(self.m)
            self.path_len = len(path) if path is not None else 0
            if path is not None and len(path) + self.margin >= remaining:
                return self._one_hot(logits, self._pick(logits, allowed, path, remaining))
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)

    def _pick(self, logits, allowed, path, remaining) -> int:
        """Near the end of the budget: a sampled token that still lets the text finish, else
        the closing path's next token."""
        allowed = allowed.copy()
        for _ in range(RESAMPLES):
            if not allowed.any():
                break
            masked = mx.where(mx.array(allowed)[None], logits, -mx.inf)
            t = int(self.sampler(masked - mx.logsumexp(masked, keepdims=True)).item())
            if self._fits(t, remaining):
                return t
            allowed[t] = False
        return path[0]

    @staticmethod
    def _one_hot(logits: mx.array, token: int) -> mx.array:
        keep = mx.arange(logits.shape[-1]) == token
        return mx.where(keep[None], mx.zeros_like(logits), -mx.inf)


def top_k_processor(k: int):
    """Keep the k most likely tokens (Anthropic's top_k, and llama-server's extension)."""

    def proc(tokens: mx.array, logits: mx.array) -> mx.array:
        if k >= logits.shape[-1]:
            return logits
        kth = mx.sort(logits, axis=-1)[:, -k][:, None]
        return mx.where(logits >= kth, logits, -mx.inf)

    return proc
