"""Triton's model-repository calls the watchdog makes: unload and load one
model. They need the admin key (the model-repository API is restricted to
it), which only the launcher and the watchdog hold."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

ADMIN_KEY_HEADER = "specdec-admin-key"  # launcher.launch.ADMIN_KEY_HEADER (tests keep them equal)


class AdminError(RuntimeError):
    pass


def _post(url: str, body: dict, admin_key: str, timeout: float) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={ADMIN_KEY_HEADER: admin_key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace").strip()
        raise AdminError(f"{url}: HTTP {error.code} {detail}") from None
    except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
        raise AdminError(f"{url}: {error}") from None


def unload(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Unload ``model`` alone (models that call it, like the coordinator, stay)."""
    _post(f"{http_url}/v2/repository/models/{model}/unload", {"parameters": {"unload_dependents": False}},
          admin_key, timeout)


def load(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Load ``model`` from the repository; returns once it is ready (or raises)."""
    _post(f"{http_url}/v2/repository/models/{model}/load", {}, admin_key, timeout)


def reload(http_url: str, model: str, admin_key: str, timeout: float) -> None:
    """Unload, then load. Loading over a loaded model would keep the dead
    instance serving (and the server ready) until the new one is up; unloaded
    first, the model is loading meanwhile, so strict readiness says not ready."""
    unload(http_url, model, admin_key, timeout)
    load(http_url, model, admin_key, timeout)
