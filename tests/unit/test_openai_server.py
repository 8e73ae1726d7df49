"""The OpenAI frontend's HTTP layer (frontend/openai_server.py) on a fake
coordinator: status codes and error bodies in OpenAI's format (never
FastAPI's 422), what reaches the coordinator, and the SSE stream. Fast; the
real server is tests/server/test_openai_api.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from coordinator.request.api import Statistics
from frontend.coordinator_client import CoordinatorFailure, Piece
from frontend.openai_server import DEFAULT_MAX_TOKENS, Settings, create_app


class FakeCoordinator:
    def __init__(self, pieces=(), failure: CoordinatorFailure | None = None, fail_after: int = 0, ready=True):
        self.pieces = list(pieces)
        self.failure = failure
        self.fail_after = fail_after
        self.is_ready = ready
        self.requests: list[dict] = []
        self.closed_early = 0

    async def ready(self) -> bool:
        return self.is_ready

    async def close(self) -> None:
        pass

    async def generate(self, inputs):
        self.requests.append(dict(inputs))
        finished = False
        try:
            for index, piece in enumerate(self.pieces):
                if self.failure and index == self.fail_after:
                    finished = True
                    raise self.failure
                finished = piece.final  # as the real client: done once the final response is read
                yield piece
            finished = True
            if self.failure and self.fail_after >= len(self.pieces):
                raise self.failure
        finally:
            self.closed_early += not finished


class FakePrompts:
    def chat(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def count(self, text: str) -> int:
        return len(text.split())


def final(text: str, tokens: int) -> Piece:
    return Piece(text, Statistics(draft_tokens=6, accepted_draft_tokens=3, acceptance_rate=0.5,
                                  completion_tokens=tokens))


def serve(coordinator: FakeCoordinator) -> TestClient:
    app = create_app(Settings(grpc_url="fake:8001"), FakePrompts(), connect=lambda url: coordinator)
    return TestClient(app, raise_server_exceptions=False)


def events(response) -> list:
    text = response.text
    assert text.endswith("data: [DONE]\n\n")
    blocks = text.split("\n\n")[:-1]
    assert all(block.startswith("data: ") for block in blocks)
    return [json.loads(block[len("data: "):]) for block in blocks[:-1]]


def assert_openai_error(response, status: int, param=None, words: str = ""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


COMPLETION = {"model": "coordinator", "prompt": "def f(x):"}
CHAT = {"model": "coordinator", "messages": [{"role": "user", "content": "hi"}]}


def test_models_lists_the_coordinator_and_nothing_else():
    with serve(FakeCoordinator()) as client:
        listing = client.get("/v1/models").json()
        assert [model["id"] for model in listing["data"]] == ["coordinator"] and listing["object"] == "list"
        assert client.get("/v1/models/coordinator").json()["id"] == "coordinator"
        assert_openai_error(client.get("/v1/models/gpt-4o"), 404, "model", "'gpt-4o'")
        assert_openai_error(client.post("/v1/completions", json={**COMPLETION, "model": "gpt-4o"}), 404, "model")


def test_bodies_fastapi_would_answer_with_422_get_openai_400s():
    with serve(FakeCoordinator()) as client:
        assert_openai_error(client.post("/v1/completions", content=b'{"model": ', headers={
            "content-type": "application/json"}), 400, None, "not valid JSON")
        assert_openai_error(client.post("/v1/completions", json=["coordinator"]), 400, None, "JSON object")
        assert_openai_error(client.post("/v1/completions", content=json.dumps(COMPLETION), headers={
            "content-type": "application/x-www-form-urlencoded"}), 400, None, "Content-Type: application/json")
        assert_openai_error(client.post("/v1/completions", json={**COMPLETION, "max_tokens": "8"}), 400,
                            "max_tokens", "must be an integer")
        assert_openai_error(client.get("/v1/nothing"), 404)


def test_a_completion_sends_the_inputs_and_answers_with_usage_and_statistics():
    coordinator = FakeCoordinator([final("    return x", 4)])
    with serve(coordinator) as client:
        response = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 4, "seed": 7, "stop": "\n"})
    assert response.status_code == 200
    assert coordinator.requests == [{"text_input": "def f(x):", "max_tokens": 4, "random_seed": 7,
                                     "stop_words": ["\n"], "stream": False}]
    body = response.json()
    assert body["choices"][0]["text"] == "    return x" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert body["speculation"]["total_draft_tokens"] == 6 and body["speculation"]["acceptance_rate"] == 0.5


def test_a_request_without_max_tokens_sends_the_coordinators_default():
    coordinator = FakeCoordinator([final("x", 1)])
    with serve(coordinator) as client:
        assert client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["finish_reason"] == "stop"
    assert coordinator.requests[0]["max_tokens"] == DEFAULT_MAX_TOKENS == 128


def test_a_chat_stream_is_sse_chunks_as_they_come_then_done():
    coordinator = FakeCoordinator([Piece("Hel"), Piece("lo"), final("!", 3)])
    with serve(coordinator) as client:
        response = client.post("/v1/chat/completions", json={
            **CHAT, "stream": True, "max_completion_tokens": 3, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
    assert coordinator.requests[0]["text_input"] == "<user>hi<assistant>"
    assert coordinator.requests[0]["stream"] is True and coordinator.requests[0]["max_tokens"] == 3
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": "Hel"}, {"content": "lo"}, {"content": "!"}]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["prompt_tokens"] == 1
    assert chunks[3]["speculation"]["completion_tokens"] == 3
    assert coordinator.closed_early == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_by_the_coordinator_is_a_400_naming_the_openai_field(stream):
    failure = CoordinatorFailure("max_tokens must be between 1 and 1024, got 0")
    with serve(FakeCoordinator(failure=failure)) as client:
        response = client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 0, "stream": stream})
    assert_openai_error(response, 400, "max_completion_tokens", "max_tokens must be between 1 and 1024, got 0")


def test_an_engine_failure_is_a_500_and_an_unreachable_server_too():
    with serve(FakeCoordinator(failure=CoordinatorFailure("target engine failed: out of memory"))) as client:
        assert_openai_error(client.post("/v1/completions", json=COMPLETION), 500, None, "target engine failed")
    unreachable = CoordinatorFailure("the coordinator at fake:8001 is unreachable: connection refused", transport=True)
    with serve(FakeCoordinator(failure=unreachable)) as client:
        assert_openai_error(client.post("/v1/completions", json={**COMPLETION, "stream": True}), 500, None,
                            "unreachable")


def test_a_failure_after_the_stream_started_is_an_error_event():
    coordinator = FakeCoordinator([Piece("a"), Piece("b")], failure=CoordinatorFailure("target engine failed: x"),
                                  fail_after=1)
    with serve(coordinator) as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert response.status_code == 200
    chunks = events(response)
    assert chunks[0]["choices"][0]["text"] == "a"
    assert chunks[1]["error"]["type"] == "server_error" and "target engine failed" in chunks[1]["error"]["message"]


def test_health_follows_the_coordinator():
    with serve(FakeCoordinator()) as client:
        assert client.get("/health").status_code == 200
    with serve(FakeCoordinator(ready=False)) as client:
        assert_openai_error(client.get("/health"), 503, None, "not ready")


# ------------------------------------------------------ API key, admission ----

API_KEY = "the-api-key-0123456789"


def serve_with_key(coordinator: FakeCoordinator) -> TestClient:
    app = create_app(Settings(grpc_url="fake:8001", api_key=API_KEY), FakePrompts(), connect=lambda url: coordinator)
    return TestClient(app, raise_server_exceptions=False)


def assert_unauthorized(response, words: str):
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and words in error["message"] and API_KEY not in error["message"]


def test_with_an_api_key_every_endpoint_but_health_needs_the_bearer_token():
    coordinator = FakeCoordinator([final("x", 1)])
    with serve_with_key(coordinator) as client:
        for method, path, body in (("post", "/v1/completions", COMPLETION), ("post", "/v1/chat/completions", CHAT),
                                   ("get", "/v1/models", None), ("get", "/v1/models/coordinator", None)):
            call = getattr(client, method)
            kwargs = {"json": body} if body else {}
            assert_unauthorized(call(path, **kwargs), "Authorization: Bearer <key>")
            assert_unauthorized(call(path, headers={"Authorization": f"Bearer {API_KEY}x"}, **kwargs), "not this")
            assert_unauthorized(call(path, headers={"Authorization": f"Basic {API_KEY}"}, **kwargs), "Bearer <key>")
            assert_unauthorized(call(path, headers={"specdec-api-key": API_KEY}, **kwargs), "Bearer <key>")
        assert coordinator.requests == []  # nothing reached the coordinator
        assert client.get("/health").status_code == 200  # probes and the launcher's wait need no key
        answer = client.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"bearer {API_KEY}"})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "x"
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_without_an_api_key_nothing_is_asked_for():
    with serve(FakeCoordinator([final("x", 1)])) as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_the_key_is_compared_in_constant_time(monkeypatch):
    from frontend import openai_server

    compared = []
    real = openai_server.hmac.compare_digest
    monkeypatch.setattr(openai_server.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert openai_server.key_matches(API_KEY, API_KEY) and not openai_server.key_matches("x" * 22, API_KEY)
    assert compared == [(API_KEY.encode(), API_KEY.encode()), (b"x" * 22, API_KEY.encode())]
    assert not openai_server.key_matches(None, API_KEY)
    assert openai_server.bearer_token("Bearer  abc ") == "abc" and openai_server.bearer_token("Bearer") is None
    assert "the-api-key" not in repr(Settings(api_key=API_KEY))


def test_the_frontend_sends_its_key_on_to_triton(monkeypatch):
    import asyncio

    from coordinator.request.access import GRPC_API_KEY_HEADER
    from frontend import coordinator_client, openai_server

    made = []
    monkeypatch.setattr(openai_server, "CoordinatorClient",
                        lambda url, api_key=None: made.append((url, api_key)) or FakeCoordinator())
    with TestClient(create_app(Settings(grpc_url="fake:8001", api_key=API_KEY), FakePrompts())):
        pass
    assert made == [("fake:8001", API_KEY)]

    sent = []

    class Call:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        def cancel(self):
            pass

    async def stream():
        client = coordinator_client.CoordinatorClient("127.0.0.1:1", api_key=API_KEY)
        client._client.stream_infer = lambda requests, headers=None: sent.append(headers) or Call()
        with pytest.raises(CoordinatorFailure):  # the fake stream ends without a final response
            async for _ in client.generate({"text_input": "x"}):
                pass
        await client.close()

    asyncio.run(stream())
    assert sent == [{GRPC_API_KEY_HEADER: API_KEY}]


@pytest.mark.parametrize("stream", [False, True])
def test_the_coordinators_refusal_at_max_inflight_requests_is_a_429_with_retry_after(stream):
    from coordinator.request.admission import refusal_message

    failure = CoordinatorFailure(f"[request id: 7] {refusal_message(8)}")
    with serve(FakeCoordinator(failure=failure)) as client:
        response = client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert "max_inflight_requests" in error["message"] and "8 requests are in flight" in error["message"]
    assert error["type"] == "server_busy" and error["code"] == "max_inflight_requests"
