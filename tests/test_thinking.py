"""A model's thinking comes back as each dialect's reasoning (issue 44 item 1): Anthropic
`thinking` blocks (streamed as thinking deltas), Responses `reasoning` items, chat
completions' `reasoning_content`, parsed by the official `anthropic` and `openai` clients.

The shipped models have no thinking mode, so the demo model is served in process with a chat
template that has one (`enable_thinking` opens `<think>` in the generation prompt, as a
thinking Qwen's does): the answer then starts inside a think block, deterministically, and
what the model writes before any `</think>` is its thinking. Where a think block ends and the
answer starts is the splitter's, tested pure with the pieces cut everywhere."""

import json
import shutil
import time

import anthropic
import openai
import pytest

from macserve.server.events import Text, Thinking
from macserve.server.thinking import Splitter, Think

from .conftest import TINY_MODEL

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + "
    "'<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Good morrow."}]
GREEDY = {"temperature": 0}  # this anthropic client has no temperature argument


def _split(think: Think, pieces: list[str]) -> tuple[str, str]:
    s, out = Splitter(think), []
    for p in pieces:
        out += s.feed(p)
    out += s.flush()
    thought = "".join(e.text for e in out if isinstance(e, Thinking))
    text = "".join(e.text for e in out if isinstance(e, Text))
    return thought, text


def test_the_splitter_finds_a_think_block_however_the_text_is_cut():
    closed = Think("<think>", "</think>", open=False)
    answer = "<think>\nFirst, the sum.\n</think>\n\nIt is 19."
    for cut in range(len(answer) + 1):
        for step in (1, 3):
            pieces = [answer[:cut]] + [answer[i : i + step] for i in range(cut, len(answer), step)]
            assert _split(closed, pieces) == ("First, the sum.", "It is 19."), pieces
    # the prompt opened the block: the answer's first words are thinking
    opened = Think("<think>", "</think>", open=True)
    assert _split(opened, ["Hm", "m.</th", "ink>Yes."]) == ("Hmm.", "Yes.")
    assert _split(opened, ["cut short by max_tok", "ens </thi"]) == (
        "cut short by max_tokens </thi",
        "",
    )
    # no think block, or one quoted mid-answer: all of it is the answer
    assert _split(closed, ["  Yes", ", <think> is a tag"]) == ("", "  Yes, <think> is a tag")
    assert _split(closed, ["<thi", "nking>"]) == ("", "<thinking>")


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """The demo model with a thinking chat template, served in process: the official clients
    over Starlette's TestClient (an httpx.Client), through the server's real app."""
    from starlette.testclient import TestClient

    from macserve.server.app import create_app
    from macserve.server.settings import Settings

    folder = tmp_path_factory.mktemp("thinking-model")
    for f in TINY_MODEL.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((TINY_MODEL / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": THINKING_TEMPLATE})
    )
    app = create_app(Settings(str(folder), ctx=256))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:  # the model loads in the background
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.05)
        yield (
            anthropic.Anthropic(
                base_url="http://127.0.0.1", api_key="x", http_client=http, max_retries=0
            ),
            openai.OpenAI(
                base_url="http://127.0.0.1/v1", api_key="x", http_client=http, max_retries=0
            ),
        )
    shutil.rmtree(folder)


@pytest.mark.model
def test_thinking_comes_back_as_each_dialects_reasoning(clients):
    claude, gpt = clients
    # Anthropic, whole: the reasoning in a thinking block, the header says thinking is on
    raw = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=6, messages=ASK, thinking={"type": "adaptive"}, extra_body=GREEDY
    )
    assert raw.headers["x-macserve-thinking"] == "on"
    m = raw.parse()
    assert m.content[0].type == "thinking" and m.content[0].thinking
    thought = m.content[0].thinking
    # streamed: thinking deltas, the SDK's accumulated message equal to the whole one
    with claude.messages.stream(
        model="tiny", max_tokens=6, messages=ASK, thinking={"type": "adaptive"}, extra_body=GREEDY
    ) as s:
        deltas = [e.delta.thinking for e in s if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]  # fmt: skip
        final = s.get_final_message()
    assert "".join(deltas) == thought == final.content[0].thinking
    # disabled: the template opens no think block, so the same words are the answer's text
    m = claude.messages.create(
        model="tiny", max_tokens=6, messages=ASK, thinking={"type": "disabled"}, extra_body=GREEDY
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text

    # Responses: a reasoning item with the text, its tokens counted; streamed the same
    r = gpt.responses.create(
        model="tiny", input=ASK, max_output_tokens=6, reasoning={"effort": "high"}, temperature=0
    )
    (item,) = [o for o in r.output if o.type == "reasoning"]
    assert item.content[0].type == "reasoning_text" and item.content[0].text == thought
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    with gpt.responses.stream(
        model="tiny", input=ASK, max_output_tokens=6, reasoning={"effort": "high"}, temperature=0
    ) as s:
        events = list(s)  # the accumulator checks each event against the items so far
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = events[-1].response  # response.incomplete: max_output_tokens ended it
    assert text == thought == done.output[0].content[0].text

    # chat completions (the template's default: mlx-lm passes enable_thinking when the model's
    # vocabulary has think tokens; this one's has none, so it is asked for)
    c = gpt.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert c.choices[0].message.reasoning_content == thought
