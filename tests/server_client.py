"""Calls to the test server (gRPC, HTTP and metrics ports) and the inputs
they need, shared by the real-server test modules. Inference calls carry the
server's API key (``server.api_key``) as Triton expects it."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from coordinator.request.access import API_KEY_HEADER, grpc_headers
from tools.prompts import load_humaneval
from tools.client import Completion, build_inputs, stream_completion
from tools.scrape import fetch_metrics, metric_value


def humaneval_prompts(*task_numbers: int) -> list[str]:
    problems = load_humaneval()
    return [problems[f"HumanEval/{n}"] for n in task_numbers]


def tensor(name, array, dtype) -> grpcclient.InferInput:
    array = np.asarray(array)
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def complete(server, prompt, max_tokens: int, timeout: float = 300.0, **kwargs) -> Completion:
    """One streamed completion from the coordinator (``kwargs``: build_inputs' options)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        return stream_completion(client, build_inputs(prompt, max_tokens, **kwargs), timeout=timeout,
                                 headers=grpc_headers(server.api_key))


def concurrently(server, jobs, timeout: float = 600.0) -> list[Completion]:
    """One completion per (prompt, build_inputs options) job, all streams at once;
    any failure is re-raised."""
    results: list = [None] * len(jobs)
    failures: list[BaseException] = []

    def run(i):
        prompt, kwargs = jobs[i]
        try:
            results[i] = complete(server, prompt, **kwargs)
        except BaseException as error:  # re-raised below
            failures.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if failures:
        raise failures[0]
    return results


def grpc_error(server, inputs, timeout: float = 60.0) -> str:
    """The error message the server answers ``inputs`` with (fails if it answers otherwise)."""
    with pytest.raises(InferenceServerException) as error:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            stream_completion(client, inputs, timeout=timeout, headers=grpc_headers(server.api_key))
    return error.value.message()


def http_status(server, path, method="GET", headers=None, body=None, api_key=True) -> tuple[int, str]:
    """(status, body) of an HTTP call; a POST without a body sends ``{}``.
    ``api_key``: send the server's API key (unless ``headers`` carry one)."""
    if body is None and method == "POST":
        body = b"{}"
    headers = dict(headers or {})
    if api_key and server.api_key:
        headers.setdefault(API_KEY_HEADER, server.api_key)
    request = urllib.request.Request(f"{server.http_url}{path}", method=method, headers=headers, data=body)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def metrics_text(server) -> str:
    return fetch_metrics(f"{server.metrics_url}/metrics")


def metric(body: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels`` (fails if none is exported)."""
    try:
        return metric_value(body, name, **labels)
    except KeyError as missing:
        raise AssertionError(str(missing)) from None


def engine_responses(server, model: str, tensors: dict, outputs, timeout: float = 120.0) -> list:
    """A request straight to an engine model, over a gRPC stream as NVIDIA's
    clients drive a decoupled tensorrt_llm model: its responses up to the
    final one (an error response raises InferenceServerException)."""
    import queue

    from tritonclient.utils import np_to_triton_dtype

    inputs = [tensor(name, array, np_to_triton_dtype(array.dtype)) for name, array in tensors.items()]
    answers: queue.Queue = queue.Queue()
    results = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)),
                            headers=grpc_headers(server.api_key))
        try:
            client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                                      enable_empty_final_response=True)
            while True:
                result, error = answers.get(timeout=timeout)
                if error is not None:
                    raise error
                if result.as_numpy(outputs[0]) is not None:
                    results.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return results
        finally:
            client.stop_stream()

