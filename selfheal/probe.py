"""A one-token inference sent straight to an engine (``target`` or
``draft``) in the tensorrtllm contract: the check that works for any backend
(the GPU path's TensorRT-LLM executors have no stub to watch) and that also
notices an engine that is alive but no longer answers. The same to the
coordinator is its first request (which times the engines before it is served)."""

from __future__ import annotations

import queue

import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from coordinator.engines.tensors import REQUESTED_OUTPUTS, engine_inputs
from coordinator.request.access import grpc_headers
from coordinator.sampling.params import SamplingParams
from tools.client import build_inputs

GREEDY = SamplingParams(top_k=1)


def probe_inputs(seed_input: str = "random_seed") -> list[grpcclient.InferInput]:
    """One prompt token (id 0), one new token, greedy."""
    inputs = []
    for name, array in engine_inputs([0], 1, GREEDY, end_id=0, pad_id=0, seed_input=seed_input).items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def probe(grpc_url: str, model: str, timeout: float, seed_input: str = "random_seed",
          api_key: str | None = None, coordinator: bool = False) -> tuple[bool, str]:
    """(True, "") when ``model`` answered within ``timeout`` seconds, else (False, why).
    ``api_key``: Triton's inference key, when it has one (a probe is an inference call).
    ``coordinator``: ``model`` speaks the coordinator's contract, not an engine's."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    # the coordinator's: a one-token completion of "def", in one response
    inputs, outputs = ((build_inputs("def", 1, stream=False), ["text_output"]) if coordinator
                       else (probe_inputs(seed_input), REQUESTED_OUTPUTS))
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=timeout,
                            headers=grpc_headers(api_key))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput(name) for name in outputs])
        while True:
            try:
                result, error = answers.get(timeout=timeout)
            except queue.Empty:
                return False, f"no answer to a one-token probe within {timeout:g} s"
            if error is not None:
                return False, error.message() if hasattr(error, "message") else str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return True, ""
    except Exception as error:  # noqa: BLE001 - any failure to reach the model is the answer
        return False, str(error)
    finally:
        try:
            client.stop_stream(cancel_requests=True)
            client.close()
        except Exception:  # noqa: BLE001 - the probe's verdict stands
            pass
