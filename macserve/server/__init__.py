"""macserve's OpenAI-compatible HTTP server for the MLX engine (`macserve serve MODEL`).

app.py (routes, auth, streaming, uvicorn), protocol.py (request validation and response
shapes), worker.py (the single thread that owns the model and runs one generation at a time).
"""
