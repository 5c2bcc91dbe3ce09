"""The benchmark client's untimed conversations with the server: reachability, model discovery from
`/v1/models`, finding a tokenizer for the served model, `/get_server_info` and `/flush_cache`.

Tokenizer resolution, first that works: `--tokenizer` or the model id when it is `smollm2` (tokenloom's default
model) or a local Hugging Face folder or `.gguf` file (loaded the way the tokenloom server loads it, so a GGUF
tokenizer is rebuilt once and cached); else the server's `/get_model_info` `model_path`/`tokenizer_path` when
it is local; else `AutoTokenizer.from_pretrained(name)` (an id in the local Hugging Face cache). Failure is a
`BenchError` that says to pass `--tokenizer`.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from typing import Any

PROBE_TIMEOUT_S = 10.0


class BenchError(RuntimeError):
    """A problem the user can fix (server unreachable, no model, no tokenizer): printed as one line."""


def http_json(method: str, url: str, headers: dict[str, str] | None = None,
              timeout: float = PROBE_TIMEOUT_S) -> tuple[int, Any]:
    """(status, parsed JSON or text). Connection problems raise `BenchError`."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BenchError(f"cannot reach the server at {url}: {reason}") from None
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def discover_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model id of GET /v1/models (also the reachability check)."""
    status, body = http_json("GET", f"{base_url}/v1/models", headers)
    if status == 401:
        raise BenchError(f"{base_url}/v1/models answered 401: set OPENAI_API_KEY to the server's API key")
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise BenchError(f"cannot discover the model: GET {base_url}/v1/models answered {status}; pass --model")
    model = body["data"][0].get("id")
    if not isinstance(model, str) or not model:
        raise BenchError(f"GET {base_url}/v1/models returned no model id; pass --model")
    return model


def check_reachable(base_url: str, headers: dict[str, str]) -> None:
    """Raise `BenchError` when nothing answers at `base_url` (any HTTP status counts as an answer)."""
    http_json("GET", f"{base_url}/v1/models", headers)


def _is_local_model(name: str) -> bool:
    from tokenloom.models.default_model import DEFAULT_MODEL_ALIAS

    path = os.path.expanduser(name)
    return name == DEFAULT_MODEL_ALIAS or os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf"))


def _load_local(name: str) -> Any:
    """A tokenizer for 'smollm2', a Hugging Face folder or a GGUF file, loaded as the tokenloom server does."""
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    path = os.path.expanduser(name)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                   for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return load_tokenizer(resolve_model_source(ServerArgs(model_path=name)))


def _server_model_paths(base_url: str, headers: dict[str, str]) -> list[str]:
    try:
        status, info = http_json("GET", f"{base_url}/get_model_info", headers)
    except BenchError:
        return []
    if status != 200 or not isinstance(info, dict):
        return []
    found = [info.get("tokenizer_path"), info.get("model_path")]
    return [p for p in found if isinstance(p, str) and p and _is_local_model(p)]


def load_bench_tokenizer(name: str, base_url: str, headers: dict[str, str]) -> Any:
    """The tokenizer for `name` (the --tokenizer flag or the model id); see the module docstring."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tried = []
    candidates = [name] if _is_local_model(name) else []
    candidates += [p for p in _server_model_paths(base_url, headers) if p not in candidates]
    for candidate in candidates:
        try:
            return _load_local(candidate)
        except Exception as e:  # noqa: BLE001 - try the next candidate, report them all if none works
            tried.append(f"{candidate}: {e}")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - any loader failure means: tell the user to pass --tokenizer
        tried.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    raise BenchError(f"cannot load a tokenizer for {name!r} ({'; '.join(tried)}); pass --tokenizer with a local "
                     "Hugging Face folder, a .gguf file or 'smollm2'")


def get_server_info(base_url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """GET /get_server_info, or None when the server has no such route."""
    try:
        status, info = http_json("GET", f"{base_url}/get_server_info", headers)
    except BenchError:
        return None
    return info if status == 200 and isinstance(info, dict) else None


def flush_cache(base_url: str, headers: dict[str, str]) -> str | None:
    """POST /flush_cache; an error message, or None when it worked."""
    try:
        status, body = http_json("POST", f"{base_url}/flush_cache", headers)
    except BenchError as e:
        return str(e)
    return None if status == 200 else f"/flush_cache answered {status}: {body}"
