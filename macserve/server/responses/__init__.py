"""OpenAI's Responses API: POST /v1/responses (what Codex speaks). request.py parses a body
(with pydantic) into the neutral GenerationRequest, render.py writes a `response` object and
its stream of typed events, serving.py turns a job's events into either."""
