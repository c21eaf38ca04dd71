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
  state.py  what a running router tells `macserve ls`: a small JSON file per router.

This package's __init__ imports nothing: `services.manager` reads state.py, and pool.py
imports the manager.
"""
