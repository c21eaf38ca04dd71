"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens. request.py parses a
body into the neutral GenerationRequest, render.py writes Anthropic's shapes and its event
stream, serving.py turns a job's events into a whole message or a stream."""
