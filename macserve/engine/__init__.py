"""The engine: MLX runtime for MLA models with the rotated INT2 latent cache and MTP drafting.

A leaf below the server: it imports mlx, mlx-lm, int2_format and errors, never
services/ or dev/.

    model.py         the one loader (dtype rule, MLA layers patched) -> Bundle
    caches.py        CacheSpec / EngineOptions (frozen, resolved once) and make_caches
    latent_cache.py  RotatedLatentCache: INT2 codes + bf16 sink/recent windows, mlx-lm's protocol
    mla_attention.py absorbed MLA attention reading the codes without dequantizing
    dsa_indexer.py   DSA models: the 8-bit indexer key cache and top-k selection
    calibration.py   per-layer rotations and clips, fitted from calibration text
    mtp_layer.py     DeepSeek's MTP block on mlx-lm's decoder layer
    mtp_decode.py    MTP speculative decoding: MTPDecoder (a round, the prefill, generate)
    mtp_accept.py    what a round keeps: acceptance rules, draft statistics, exact rollback
    mtp_pipelined.py greedy k = 1 with the next round built before this one is read
    mtp_auto_decode.py  `--mtp auto`'s loop: spans of plain steps or rounds, timed
    mtp_auto.py      `--mtp auto`'s rule: paired tokens/s of both modes, margin, re-checks
    mtp_auto_store.py   `--mtp auto`'s figures kept beside the prompt cache across restarts
    generate.py      the streaming decode loop the server and CLI use
    pipeline.py      uneven pipeline splits under mlx.launch
    bench/           `macserve bench kv|mtp|dsa`
"""
