"""Answers stop at the end of the turn: the demo model's chat template closes a turn with
`<|end|>`, its tokenizer's eos is `<|eos|>`; the engine stops at the template's turn end
(engine/model.py: turn_end_tokens), so an answer is one turn, not 1,000 tokens running on
through the template's markers into made-up turns."""

import openai

from macserve.engine.model import turn_end_tokens

from .conftest import TINY_MODEL
from .serverproc import serve

PROMPTS = ["Who's there?", "What country, friends, is this?", "Good morrow, sir."]


def test_the_template_turn_end_is_found_on_the_demo_tokenizer():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(TINY_MODEL)
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|eos|>")}
    assert turn_end_tokens(tok) == [tok.convert_tokens_to_ids("<|end|>")]


def test_chat_answers_end_at_the_turn(tmp_path):
    with serve(tmp_path) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for p in PROMPTS:
            r = c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": p}],
                max_tokens=600,
                temperature=0,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "stop", (p, r.usage, choice.message.content)
            assert "<|" not in choice.message.content, choice.message.content
            assert r.usage.completion_tokens < 600
