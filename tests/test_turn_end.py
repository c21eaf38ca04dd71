"""Answers stop at the end of the turn: the demo model's chat template closes a turn with
`<|end|>`, its tokenizer's eos is `<|eos|>` (mlx-lm stops only at the latter); the engine's
loader adds the template's turn end to the ids every generation path stops at
(engine/model.py: turn_end_tokens; the scheduler, `generate` and the grammar all read
`Bundle.eos_ids`)."""

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from macserve.engine.model import load, turn_end_tokens

from .conftest import TINY_MODEL

pytestmark = pytest.mark.model


def test_the_template_turn_end_is_found_on_the_demo_tokenizer():
    tok = load_tokenizer(TINY_MODEL)
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|eos|>")}
    assert turn_end_tokens(tok) == [tok.convert_tokens_to_ids("<|end|>")]


def test_templates_without_a_special_turn_end_add_nothing():
    tok = load_tokenizer(TINY_MODEL)
    tok._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert turn_end_tokens(tok) == []  # a newline is not a turn end
    tok._tokenizer.chat_template = "{{ raise_exception('system messages only') }}"
    assert turn_end_tokens(tok) == []  # a template that refuses the probe


def test_the_engine_stops_at_the_turn_end():
    b = load(TINY_MODEL)
    tok = b.tokenizer
    assert b.eos_ids == {tok.convert_tokens_to_ids("<|eos|>"), tok.convert_tokens_to_ids("<|end|>")}
