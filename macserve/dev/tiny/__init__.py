"""The project's own tiny DeepSeek-V3-architecture model: data, tokenizer, training.

Everything here is a developer tool (`macserve dev train-tiny`); users only load the result
from `macserve/models/tiny-mla/`.
"""
