"""`macserve router`: one OpenAI- and Anthropic-compatible endpoint for every profile. A wing
above services: it drives them (`services.lifecycle`, `services.routed`, ...); only the CLI imports
it (tests/test_architecture.py checks both).

  pool.py       which profiles exist, which run, and when to start or stop one: each profile
                started on its first request (once, however many requests race), stopped after
                its TTL of idleness; its collaborators (supervisor, start, stop, shares,
                free memory, clocks) injected as one `PoolOps` (ops.py; the real ones from
                the services wing, fakes in tests/test_pool.py).
  admission.py  the memory budget: a start admitted if its share fits beside the shares of
                what runs and the machine has it free now, idle profiles evicted least
                recently used first, never one in use
  state.py      a profile's states (stopped, starting, running, stopping, failed), the moves
                allowed between them, and the one `transition` that makes and logs a move
  model.py      what the router knows of one profile (`Model`), and its `Settings`
  proxy.py      forwarding: hold a request while its model starts (keepalive.py: each
                dialect's keep-alive for a stream, a loading note in chat completions), pass
                the answer through untouched (rename.py: the `model` asked for), end a stream
                whose server died with an error event
  responses.py  /v1/responses for a server with only chat completions (mlx_lm.server):
                the request and its answer translated
  app.py        the routes (starlette + uvicorn): /health, /metrics, /v1/models, /v1/...
                to the proxy, /ui (ui.py, ui_ops.py, ui_page.py, static/); `run`
  metrics.py    tokens/s and time to first token of what it streams (the page's live figures)
  prom.py       its Prometheus `/metrics`; activity.py: work a server did past the router

What a running router tells `macserve ls` (a small JSON file per router) is
`services/routed.py`: the router writes it, `ls` reads it. This package's __init__ imports
nothing.
"""
