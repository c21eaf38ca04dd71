"""macserve's OpenAI- and Anthropic-compatible HTTP server for the MLX engine
(`macserve serve MODEL`).

app.py (routes, auth, uvicorn), serving.py (a request's way through the engine), openai/,
anthropic/ and responses/ (one folder per API: request parsing, response shapes, streaming), request.py and
events.py (the neutral request and the typed events between the APIs and the engine),
worker.py (the thread that owns the model).
"""
