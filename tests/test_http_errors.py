"""HttpError in its two dialects (web/openai_api.py, web/anthropic_api.py), read over real HTTP
by the official openai and anthropic clients: the body each client parses, the status it
sees, the headers it obeys (Retry-After, x-should-retry: counted in requests that arrive), and
the error event that ends a stream.

The server is a few lines of Starlette on uvicorn, answering every request with the HttpError
its body describes, rendered by `web.dialects` as `serve` and the router render theirs.
"""

import collections
import json
import threading
import time

import anthropic
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from macserve import listen
from macserve.web import dialects
from macserve.web.errors import HttpError

STATUSES = (400, 401, 404, 408, 413, 429, 500, 503)
# Anthropic's error types by status, as its documentation lists them ("Errors"); 503 is our
# "overloaded", which Anthropic's API sends as 529.
ANTHROPIC = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


async def _answer(request: Request):
    d = json.loads(await request.body())
    hits[d["message"]] += 1
    e = HttpError(
        d["status"],
        d["message"],
        param=d.get("param"),
        type_=d.get("type"),
        code=d.get("code"),
        retry_after=d.get("retry_after"),
        retry=d.get("retry"),
    )
    if d.get("stream"):

        async def events():
            yield dialects.error_event(e, request.url.path)

        return StreamingResponse(events(), media_type="text/event-stream")
    return dialects.error_response(e, request.url.path)


hits: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def url():
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _answer, methods=["POST"]),
            Route("/v1/messages", _answer, methods=["POST"]),
        ]
    )
    sock = listen.bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    t.join(30)


def _openai(url, retries=0):
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=retries)


def _anthropic(url, retries=0):
    return anthropic.Anthropic(base_url=url, api_key="k", max_retries=retries)


def _chat(client, spec: dict, stream=False):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=stream, extra_body=spec
    )


def _message(client, spec: dict, stream=False):
    return client.messages.create(
        model="m",
        max_tokens=8,
        messages=[{"role": "user", "content": "hi"}],
        stream=stream,
        extra_body=spec,
    )


@pytest.mark.parametrize("status", STATUSES)
def test_openai_shape(url, status):
    spec = {"status": status, "message": f"openai {status}", "param": "messages", "code": "c"}
    with pytest.raises(openai.APIStatusError) as e:
        _chat(_openai(url), spec)
    err = e.value
    assert err.status_code == status
    expected_type = "server_error" if status >= 500 else "invalid_request_error"
    assert err.body == {
        "message": spec["message"],
        "type": expected_type,
        "param": "messages",
        "code": "c",
    }
    assert (err.type, err.param, err.code) == (expected_type, "messages", "c")
    closes = err.response.headers.get("connection") == "close"
    assert closes == (status in (408, 413))  # a body not read is not waited for either
    assert "retry-after" not in err.response.headers
    assert "x-should-retry" not in err.response.headers


@pytest.mark.parametrize("status", STATUSES)
def test_anthropic_shape(url, status):
    spec = {"status": status, "message": f"anthropic {status}", "param": "x", "code": "c"}
    with pytest.raises(anthropic.APIStatusError) as e:
        _message(_anthropic(url), spec)
    err = e.value
    assert err.status_code == (529 if status == 503 else status)
    # Anthropic's body has no param or code; its type is the status's.
    assert err.body == {
        "type": "error",
        "error": {"type": ANTHROPIC[status], "message": spec["message"]},
    }
    assert (err.response.headers.get("connection") == "close") == (status in (408, 413))


def test_openai_type_is_kept(url):
    spec = {"status": 503, "message": "openai typed", "type": "unavailable_error"}
    with pytest.raises(openai.InternalServerError) as e:
        _chat(_openai(url), spec)
    assert e.value.type == "unavailable_error"


@pytest.mark.parametrize("call,client", [(_chat, _openai), (_message, _anthropic)])
@pytest.mark.parametrize(
    "status,retry,attempts",
    [
        (503, None, 2),  # the clients' own rule: 5xx is retried
        (503, False, 1),  # the server says no (the router's errors, by default)
        (429, None, 2),
        (400, None, 1),
        (400, True, 2),  # the server says yes, whatever the status
    ],
)
def test_retry_headers_are_obeyed(url, call, client, status, retry, attempts):
    spec = {
        "status": status,
        "message": f"{call.__name__} {status} {retry}",
        "retry": retry,
        "retry_after": 0.2,  # sent as a whole second: Retry-After has no fractions
    }
    t0 = time.monotonic()
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as e:
        call(client(url, retries=1), spec)
    assert hits[spec["message"]] == attempts
    headers = e.value.response.headers
    assert headers["retry-after"] == "1"
    assert headers.get("x-should-retry") == (None if retry is None else str(retry).lower())
    if attempts > 1:  # the client waited the Retry-After before trying again
        assert time.monotonic() - t0 >= 1


def test_openai_stream_ends_with_the_error(url):
    spec = {"status": 500, "message": "openai stream cut", "stream": True}
    stream = _chat(_openai(url), spec, stream=True)
    with pytest.raises(openai.APIError) as e:
        list(stream)
    assert e.value.message == "openai stream cut"
    assert e.value.body["type"] == "server_error"
    raw = dialects.error_event(HttpError(500, "x"), "/v1/chat/completions")
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")  # clients that read on stop at [DONE]


def test_anthropic_stream_ends_with_the_error(url):
    spec = {"status": 503, "message": "anthropic stream cut", "stream": True}
    stream = _message(_anthropic(url), spec, stream=True)
    with pytest.raises(anthropic.APIStatusError) as e:
        list(stream)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "anthropic stream cut"},
    }
    assert dialects.error_event(HttpError(503, "x"), "/v1/messages").startswith(b"event: error\n")


def test_the_path_picks_the_dialect():
    e = HttpError(404, "m")
    for path, anthropic_shape in [
        ("/v1/messages", True),
        ("/v1/messages/count_tokens", True),
        ("/v1/chat/completions", False),
        ("/v1/models/x", False),
        ("/health", False),
    ]:
        status, headers, body = dialects.error_parts(e, path)
        assert headers["content-type"] == "application/json"
        assert (json.loads(body).get("type") == "error") == anthropic_shape, path
