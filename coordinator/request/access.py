"""Who may send the coordinator requests: the inference API key's names.

Triton checks the key before a request reaches any model (its restricted
``inference`` category, set up by ``specdec-serve`` and the trtllm
entrypoint), so the coordinator itself never sees it. Clients send it in a
header; the OpenAI-compatible frontend takes it as OpenAI clients send it
(``Authorization: Bearer <key>``) and passes it on to Triton. The tools
(``specdec-client``, the soak, the bench, the load test, AIPerf runs) read it
from the environment variable ``API_KEY_VAR``, never from their command line,
where every user of the machine could read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_VAR = "SPECDEC_API_KEY"
# The header Triton's restricted inference category expects on HTTP; on gRPC
# Triton expects it as metadata with its protocol prefix.
API_KEY_HEADER = "specdec-api-key"
GRPC_API_KEY_HEADER = "triton-grpc-protocol-" + API_KEY_HEADER


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The inference key in ``API_KEY_VAR``; None when it is unset or blank."""
    value = (os.environ if environ is None else environ).get(API_KEY_VAR, "").strip()
    return value or None


def grpc_headers(api_key: str | None) -> dict[str, str] | None:
    """gRPC metadata that carries ``api_key`` to Triton (None: no key to send)."""
    return {GRPC_API_KEY_HEADER: api_key} if api_key else None


def http_headers(api_key: str | None) -> dict[str, str]:
    """HTTP headers that carry ``api_key`` to Triton ({}: no key to send)."""
    return {API_KEY_HEADER: api_key} if api_key else {}
