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
from pathlib import Path

API_KEY_VAR = "SPECDEC_API_KEY"
# The server may read its key from a file instead (a Kubernetes Secret mounted
# as a volume: the value then appears in no environment at all).
API_KEY_FILE_VAR = "SPECDEC_API_KEY_FILE"
# The header Triton's restricted inference category expects on HTTP; on gRPC
# Triton expects it as metadata with its protocol prefix.
API_KEY_HEADER = "specdec-api-key"
GRPC_API_KEY_HEADER = "triton-grpc-protocol-" + API_KEY_HEADER


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The inference key in ``API_KEY_VAR``; None when it is unset or blank."""
    value = (os.environ if environ is None else environ).get(API_KEY_VAR, "").strip()
    return value or None


class ApiKeyError(ValueError):
    """The server's inference key setting cannot be used."""


def server_api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The key a server restricts inference to: ``API_KEY_VAR``, or the contents
    of the file ``API_KEY_FILE_VAR`` names; None where neither is set. A setting
    that is set but empty, both set at once, or a file that cannot be read is
    refused by name (a server would otherwise start open, or not at all, for a
    reason its operator cannot see)."""
    env = os.environ if environ is None else environ
    value, path = env.get(API_KEY_VAR), env.get(API_KEY_FILE_VAR)
    if value is not None and path is not None:
        raise ApiKeyError(f"set {API_KEY_VAR} or {API_KEY_FILE_VAR}, not both")
    if path is not None:
        if not path.strip():
            raise ApiKeyError(f"{API_KEY_FILE_VAR} is set but empty: name the file that holds the key, or unset it")
        try:
            value = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or "not UTF-8 text"
            raise ApiKeyError(f"{API_KEY_FILE_VAR}: cannot read {path}: {reason}") from None
        if not value.strip():
            raise ApiKeyError(f"{API_KEY_FILE_VAR}: {path} is empty; it must hold the key")
        return value.strip()
    if value is None:
        return None
    if not value.strip():
        raise ApiKeyError(f"{API_KEY_VAR} is set but empty: set a key (e.g. `openssl rand -hex 32`), "
                          "or unset it to serve without one on loopback")
    return value.strip()


def grpc_headers(api_key: str | None) -> dict[str, str] | None:
    """gRPC metadata that carries ``api_key`` to Triton (None: no key to send)."""
    return {GRPC_API_KEY_HEADER: api_key} if api_key else None


def http_headers(api_key: str | None) -> dict[str, str]:
    """HTTP headers that carry ``api_key`` to Triton ({}: no key to send)."""
    return {API_KEY_HEADER: api_key} if api_key else {}
