"""Triton's model-repository calls the watchdog makes: unload and load one
model. They need the admin key (the model-repository API is restricted to
it), which only the launcher and the watchdog hold."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

# The header Triton's restricted APIs require (the launcher configures them with
# it), and the variable that hands the key to the watchdog and the launcher.
ADMIN_KEY_HEADER = "specdec-admin-key"
ADMIN_KEY_VAR = "SPECDEC_ADMIN_KEY"
# A config parameter whose new value makes Triton load a model again: a load
# of a loaded model with an unchanged config does nothing. The engines ignore it.
GENERATION_PARAMETER = "reload_generation"


class AdminError(RuntimeError):
    pass


def _call(url: str, body: dict | None, admin_key: str, timeout: float) -> bytes:
    """POST ``body`` (GET when None) with the admin key; the response body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={ADMIN_KEY_HEADER: admin_key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace").strip()
        raise AdminError(f"{url}: HTTP {error.code} {detail}") from None
    except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
        raise AdminError(f"{url}: {error}") from None


def unload(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Unload ``model`` alone (models that call it, like the coordinator, stay)."""
    _call(f"{http_url}/v2/repository/models/{model}/unload", {"parameters": {"unload_dependents": False}},
          admin_key, timeout)


def load(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Load ``model`` from the repository; returns once it is ready (or raises)."""
    _call(f"{http_url}/v2/repository/models/{model}/load", {}, admin_key, timeout)


def reload(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Unload, then load: the model is not ready until its new instance is,
    so strict readiness turns the server not ready meanwhile (the target:
    nothing can be served without it)."""
    unload(http_url, model, admin_key, timeout)
    load(http_url, model, admin_key, timeout)


def config(http_url: str, model: str, admin_key: str, timeout: float) -> dict:
    """The model's config as Triton holds it (JSON)."""
    return json.loads(_call(f"{http_url}/v2/models/{model}/config", None, admin_key, timeout))


def load_config(http_url: str, model: str, model_config: dict, admin_key: str, timeout: float) -> None:
    """Load ``model`` with ``model_config`` in place of its repository's: a new
    instance loads while the old one serves, then they swap. Returns once the
    new one is ready (or raises)."""
    _call(f"{http_url}/v2/repository/models/{model}/load", {"parameters": {"config": json.dumps(model_config)}},
          admin_key, timeout)


def reload_in_place(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Load a new instance while the old one stays loaded, then swap: the
    model and the server stay ready (the draft: requests go on without it).
    Its current config with a new GENERATION_PARAMETER makes Triton load it
    again; the unchanged config would not."""
    current = config(http_url, model, admin_key, timeout)
    current.setdefault("parameters", {})[GENERATION_PARAMETER] = {"string_value": str(time.time_ns())}
    load_config(http_url, model, current, admin_key, timeout)
