"""`macserve router`: one OpenAI- and Anthropic-compatible endpoint for every profile.

  pool.py   which profiles exist, which run, and when to start, stop or evict one: each
            profile started on its first request (once, however many requests race), stopped
            after its TTL of idleness, and the least recently used ones stopped first when a
            start would not fit the GPU memory budget beside those running (inspect's
            footprints). It drives the services through `services.manager`.
  app.py    the HTTP side (starlette + uvicorn + httpx): route by the request's `model`, hold
            the request (or keep an SSE client alive with comments) while the model starts,
            pass the answer through untouched, end a stream whose server died with an error
            event.
What a running router tells `macserve ls` (a small JSON file per router) is
`services/routed.py`: the router writes it, `ls` reads it, and the services wing never imports
this package (tests/test_architecture.py checks it).

This package's __init__ imports nothing; pool.py imports the services wing (`manager`).
"""
