"""Developer tools, never imported at runtime: the demo model's training (tiny/) and the GGUF
export of a DeepSeek-V3-family checkpoint (gguf_export.py). `macserve dev ...` runs them."""
