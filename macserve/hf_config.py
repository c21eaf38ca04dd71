"""What a Hugging Face config.json means where more than one wing reads it: inspect's sizing
(sizing/) and the GGUF skeletons that check it against llama.cpp (dev/, which may not import
sizing). A leaf: it imports nothing of macserve."""

from __future__ import annotations


def text_config(config: dict) -> dict:
    """Multimodal configs nest the language model under `text_config`; flatten it (the top
    level's other keys kept, the text model's winning, the vision tower's dropped)."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and "num_hidden_layers" in tc:
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(tc)
        return merged
    return config
