"""What every HTTP server macserve runs shares (the engine's `serve` and the router): the one
HTTP error type and its OpenAI and Anthropic renderings, the gates between the network and
the routes (API key, Host check, CORS), uvicorn's h11 protocol with a header read timeout and
a lingering close, and the bounded request-body read.

A leaf: it imports nothing of macserve but the other leaves, so `server/` and
`router/` can both stand on it.
"""
