"""OpenAI's API: /v1/chat/completions and /v1/completions. request.py parses a body into the
neutral GenerationRequest, render.py writes OpenAI's shapes, serving.py turns a job's events
into a whole answer or a stream."""
