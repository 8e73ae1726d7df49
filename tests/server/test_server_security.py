"""The server's admin APIs are locked behind the admin key (real tritonserver,
started by launcher.launch with its restricted-API flags)."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tools.client import build_inputs, stream_completion
from launcher.launch import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER
from tests.server_client import http_status

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


def test_grpc_admin_protocols_need_the_key_and_inference_does_not(triton_server):
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
        # Open to everyone: health, metadata, inference.
        assert client.is_server_ready() and client.is_model_ready("coordinator")
        assert client.get_model_metadata("coordinator").name == "coordinator"
        assert stream_completion(client, build_inputs("def k():", 2), timeout=120).completion_tokens == 2


def test_the_admin_key_is_not_in_the_server_log(triton_server):
    if not (triton_server.log_path and triton_server.admin_key):
        pytest.skip("only for the server the tests started")
    assert triton_server.admin_key not in triton_server.log_path.read_text(errors="replace")
