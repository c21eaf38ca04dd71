"""A validated request -> what the worker runs: the prompt's token ids (chat template and
tools), the token budget within the context, and the output constraint (a JSON schema or a
forced tool call, compiled once so a grammar llguidance cannot take is the client's 400)."""

from __future__ import annotations

from ..web.errors import HttpError
from . import tools
from .grammar import ConstraintSpec, json_grammar
from .request import GenerationRequest
from .worker import Worker


def prompt_ids(bundle, req: GenerationRequest) -> list[int]:
    tok = bundle.tokenizer
    if req.kind == "chat":
        if not getattr(tok, "chat_template", None):
            raise HttpError(400, "this model has no chat template; use /v1/completions")
        fmt = tools.tool_format(tok)
        msgs, extra = tools.render(list(req.messages), req.tools if req.uses_tools else (), fmt)
        if req.thinking is not None and thinking_honoured(bundle):
            extra = {**extra, "enable_thinking": req.thinking}
        try:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, **extra)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja, role order rules)
            raise HttpError(
                400, f"the chat template rejected these messages: {e}", "messages"
            ) from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if isinstance(req.prompt, tuple):
        vocab = bundle.config.get("vocab_size")
        if vocab and max(req.prompt) >= vocab:
            raise HttpError(400, f"prompt has a token id >= the vocabulary size {vocab}", "prompt")
        return list(req.prompt)
    # mlx-lm's rule: add BOS etc. unless the prompt already starts with the BOS text.
    bos = tok.bos_token
    return tok.encode(req.prompt, add_special_tokens=bos is None or not req.prompt.startswith(bos))


def thinking_honoured(bundle) -> bool:
    """Whether the model's chat template has a thinking switch (`enable_thinking`, as Qwen's
    and DeepSeek's templates do): a request's thinking setting is passed to it there and
    accepted and ignored elsewhere."""
    template = getattr(bundle.tokenizer, "chat_template", None) or ""
    return "enable_thinking" in str(template)


def _n(k: int) -> str:
    return f"{k} token" + ("" if k == 1 else "s")


def token_budget(req: GenerationRequest, n_prompt: int, ctx: int, default: int) -> int:
    if n_prompt == 0:
        raise HttpError(400, "the prompt is empty after tokenization", "prompt")
    if n_prompt >= ctx:
        raise HttpError(
            400,
            f"the prompt is {_n(n_prompt)}; the context is {ctx}",
            "messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(default, ctx - n_prompt)
    if req.clamp_max_tokens:
        return min(req.max_tokens, ctx - n_prompt)
    if n_prompt + req.max_tokens > ctx:
        raise HttpError(
            400,
            f"prompt ({_n(n_prompt)}) + max_tokens ({req.max_tokens}) is more "
            f"than the context ({ctx})",
            "max_tokens",
            code="context_length_exceeded",
        )
    return req.max_tokens


def constraint(worker: Worker, req: GenerationRequest, max_tokens: int) -> ConstraintSpec | None:
    """The grammar the answer must follow, checked by compiling it once (a schema llguidance
    cannot take is the client's 400, before the request queues)."""
    if req.json_schema is not None:
        grammar, param = json_grammar(req.json_schema), "response_format"
    elif req.uses_tools and req.tool_choice in ("required", "function"):
        fmt = tools.tool_format(worker.bundle.tokenizer)
        grammar = tools.forced_grammar(req.tools, fmt, req.tool_name, req.parallel_tool_calls)
        param = "tool_choice"
    else:
        return None
    spec = ConstraintSpec(grammar, param, max_tokens, req.temperature, req.top_p, req.top_k)
    worker.vocab.matcher(grammar, param)
    return spec
