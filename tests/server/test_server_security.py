"""The server's admin APIs are locked behind the admin key and its inference
behind the API key, on Triton's HTTP and gRPC ports and the OpenAI frontend
(the session's real server, which specdec-serve starts with both keys);
health and metadata stay open. Each key opens its own APIs only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from coordinator.engines.tensors import engine_inputs
from coordinator.request.access import API_KEY_HEADER, GRPC_API_KEY_HEADER, grpc_headers
from coordinator.sampling.params import SamplingParams
from tools.client import build_inputs, stream_completion
from tools.stream import RequestFailed
from launcher.launch import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER
from tests.server_client import engine_responses, http_status

pytestmark = pytest.mark.slow

# (method, path) of each restricted HTTP API, one per restricted category.
HTTP_ADMIN_CALLS = [
    ("POST", "/v2/repository/index"),  # model-repository
    ("POST", "/v2/repository/models/no_such_model/unload"),  # model-repository (model control)
    ("GET", "/v2/models/coordinator/config"),  # model-config
    ("GET", "/v2/systemsharedmemory/status"),  # shared-memory
    ("POST", "/v2/systemsharedmemory/region/x/unregister"),  # shared-memory
    ("GET", "/v2/models/stats"),  # statistics
    ("GET", "/v2/trace/setting"),  # trace
    ("GET", "/v2/logging"),  # logging
]


def needs_key(server):
    if not server.admin_key:
        pytest.skip("the admin key of an external server is unknown (set SPECDEC_ADMIN_KEY)")


@pytest.mark.parametrize("method,path", HTTP_ADMIN_CALLS)
def test_http_admin_apis_refuse_callers_without_the_key(triton_server, method, path):
    status, body = http_status(triton_server, path, method)
    assert status == 403, (status, body)
    assert f"expecting header '{ADMIN_KEY_HEADER}'" in body
    status, body = http_status(triton_server, path, method, headers={ADMIN_KEY_HEADER: "wrong-key-0123456789"})
    assert status == 403, (status, body)


def test_the_key_opens_the_http_admin_apis_model_control_included(triton_server):
    """Model control is explicit (the engine watchdog reloads dead engines with
    the key): unloading a model that is not there is a harmless success."""
    needs_key(triton_server)
    key = {ADMIN_KEY_HEADER: triton_server.admin_key}
    for method, path in HTTP_ADMIN_CALLS:
        status, body = http_status(triton_server, path, method, headers=key)
        if "unregister" in path:
            assert status in (200, 400), body
        else:
            assert status == 200, (path, status, body)
    assert '"name":"coordinator"' in http_status(triton_server, "/v2/repository/index", "POST", headers=key)[1]


def test_grpc_admin_protocols_need_the_key_and_health_and_metadata_do_not(triton_server):
    needs_key(triton_server)
    calls = {
        "model-repository": lambda c, h: c.get_model_repository_index(headers=h),
        "model-config": lambda c, h: c.get_model_config("coordinator", headers=h),
        "shared-memory": lambda c, h: c.get_system_shared_memory_status(headers=h),
        "statistics": lambda c, h: c.get_inference_statistics(headers=h),
        "trace": lambda c, h: c.get_trace_settings(headers=h),
        "logging": lambda c, h: c.get_log_settings(headers=h),
    }
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        for name, call in calls.items():
            with pytest.raises(InferenceServerException) as refused:
                call(client, None)
            assert f"expecting header '{GRPC_ADMIN_KEY_HEADER}'" in refused.value.message(), name
            with pytest.raises(InferenceServerException):  # the HTTP header name is not the gRPC one
                call(client, {ADMIN_KEY_HEADER: triton_server.admin_key})
            call(client, {GRPC_ADMIN_KEY_HEADER: triton_server.admin_key})  # granted with the key
        # Open to everyone: health and metadata.
        assert client.is_server_ready() and client.is_model_ready("coordinator")
        assert client.get_model_metadata("coordinator").name == "coordinator"
        if triton_server.api_key:  # the API key opens no admin protocol
            with pytest.raises(InferenceServerException, match="expecting header"):
                client.get_model_repository_index(headers={GRPC_ADMIN_KEY_HEADER: triton_server.api_key})


def test_the_keys_are_not_in_the_server_log(triton_server):
    if not (triton_server.log_path and triton_server.admin_key and triton_server.api_key):
        pytest.skip("only for the server the tests started")
    log = triton_server.log_path.read_text(errors="replace")
    assert triton_server.admin_key not in log and triton_server.api_key not in log
    assert "inference needs the key in SPECDEC_API_KEY" in log  # what specdec-serve says instead


# -- inference: the API key ----------------------------------------------------------

GENERATE = [("/v2/models/coordinator/generate", {"text_input": "def k():", "max_tokens": 2}),
            ("/v2/models/coordinator/generate_stream", {"text_input": "def k():", "max_tokens": 2, "stream": True})]


def needs_api_key(server):
    if not server.api_key:
        pytest.skip("the server runs without an API key (set SPECDEC_API_KEY for an external one)")


def wrong_keys(server) -> list[dict]:
    """Headers that must not open inference: none, a wrong key, the admin key
    in either header, the API key under the admin header."""
    keys = [{}, {API_KEY_HEADER: "wrong-key-0123456789"}, {ADMIN_KEY_HEADER: server.api_key}]
    if server.admin_key:
        keys += [{API_KEY_HEADER: server.admin_key}, {ADMIN_KEY_HEADER: server.admin_key}]
    return keys


@pytest.mark.parametrize("path,body", GENERATE)
def test_http_inference_needs_the_api_key(triton_server, path, body):
    needs_api_key(triton_server)
    data = json.dumps(body).encode()
    for headers in wrong_keys(triton_server):
        status, answer = http_status(triton_server, path, "POST", headers=headers, body=data, api_key=False)
        assert status == 403 and f"expecting header '{API_KEY_HEADER}'" in answer, (headers.keys(), status, answer)
    status, answer = http_status(triton_server, path, "POST", body=data)  # with the key
    assert status == 200 and '"completion_tokens":2' in answer, answer
    # Health and metadata answer everyone: probes and load balancers hold no key.
    assert http_status(triton_server, "/v2/health/ready", api_key=False)[0] == 200
    assert http_status(triton_server, "/v2/models/coordinator", api_key=False)[0] == 200


def test_grpc_inference_needs_the_api_key_on_the_coordinator_and_the_engines(triton_server):
    needs_api_key(triton_server)
    inputs = build_inputs("def k():", 2)
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as client:
        for headers in wrong_keys(triton_server):
            grpc = {f"triton-grpc-protocol-{name}": value for name, value in headers.items()}
            with pytest.raises(RequestFailed, match=f"expecting header '{GRPC_API_KEY_HEADER}'"):
                stream_completion(client, inputs, timeout=60, headers=grpc)
        completion = stream_completion(client, inputs, timeout=120, headers=grpc_headers(triton_server.api_key))
        assert completion.completion_tokens == 2
    # The engines are models like the coordinator: a caller without the key cannot reach them either.
    tensors = engine_inputs([9, 10], 1, SamplingParams(top_k=1), end_id=0, pad_id=0)
    with pytest.raises(RequestFailed, match=f"expecting header '{GRPC_API_KEY_HEADER}'"):
        _engine_call_without_key(triton_server.grpc_url, tensors)
    assert engine_responses(triton_server, "target", tensors, ["output_ids"])  # with the key


def _engine_call_without_key(url, tensors):
    from tritonclient.utils import np_to_triton_dtype

    from tools.stream import responses

    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with grpcclient.InferenceServerClient(url) as client:
        list(responses(client, inputs, timeout=60, model="target", headers={}))


def openai_status(server, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.openai_url.removesuffix('/v1')}{path}", data=data,
                                     headers={"Content-Type": "application/json", **headers},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_the_openai_frontend_needs_the_api_key_as_a_bearer_token(triton_server):
    needs_api_key(triton_server)
    if not triton_server.openai_url:
        pytest.skip("no OpenAI frontend")
    body = {"model": "coordinator", "prompt": "def k():", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {API_KEY_HEADER: triton_server.api_key},
                    {"Authorization": f"Bearer {triton_server.admin_key}"} if triton_server.admin_key else {}):
        status, answer = openai_status(triton_server, "/v1/completions", headers, body)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", (headers.keys(), status, answer)
    assert openai_status(triton_server, "/v1/models", {})[0] == 401
    assert openai_status(triton_server, "/health", {})[0] == 200
    status, answer = openai_status(triton_server, "/v1/completions",
                                   {"Authorization": f"Bearer {triton_server.api_key}"}, body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
