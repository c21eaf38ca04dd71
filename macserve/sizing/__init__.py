"""Sizing: a model source -> its shape -> what each engine caches -> what fits this Mac.

A leaf wing: it imports nothing of macserve's but errors, env, fileio and int2_format, and
mlx only inside mlx_measure's measuring function (`inspect` must start fast).

    sources.py      where metadata comes from (config.json, folder, .gguf, hub repo), the HF cache
    model_source.py ModelSource, read from local files (config.json, .gguf, folder)
    hub.py          the Hugging Face hub over the network (file list, HTTP range reads)
    gguf_files.py   which GGUF files make up a model (split parts, the quant chosen)
    gguf_header.py  a GGUF header from any seekable stream (local or HTTP ranges)
    arch.py         the layer kinds and ModelShape (one layer kind per layer)
    arch_config.py  config.json -> ModelShape, per model family (arch_fields.py: one layer)
    arch_gguf.py    GGUF header -> ModelShape, as llama.cpp's loaders read it
    kv_layout.py    ModelShape -> each engine's buffers, bytes per token and per sequence
    mlx_measure.py  what mlx-lm itself allocates for a config (lazy model, its own caches)
    budget.py       this Mac's (or --memory's) GPU budget; parse_size
    host.py         the engine's dtype on this host (float32 on MLX's CPU), its figures there
    report.py       the above end to end: what `inspect` prints and `new` sizes with
    hosts.py        the plan across several Macs (pipeline / tensor splits)
"""
