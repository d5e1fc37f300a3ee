"""Request bodies of ``polymask serve``: OpenAI's and TEI's, checked field by field.

``openai_request`` reads ``POST /v1/embeddings`` (``input``, ``model``,
``encoding_format``, ``dimensions``, ``user``), ``tei_request`` reads ``POST
/embed`` (``inputs``, ``normalize``, ``truncate``, ``truncation_direction``,
``prompt_name``). Anything malformed raises ``RequestError`` with an HTTP
status (400 or 422, 413 for a limit) and the name of the field, which the
server returns as a JSON error: never a 500, never a traceback. Unknown
fields are ignored, as both APIs do.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["RequestError", "EmbeddingRequest", "parse_json", "openai_request", "tei_request"]


class RequestError(Exception):
    """A request the server refuses: ``status`` (HTTP, 4xx), ``field`` (the
    JSON field at fault, e.g. ``"input[3]"``, or ``"body"``), ``message``."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status, self.field, self.message = int(status), field, message


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    """What to embed and how: ``texts``; ``normalize`` (L2); ``truncate``
    (False: a text over the token limit is a 413); ``encoding_format``
    (``"float"`` or ``"base64"``, OpenAI's); ``model`` (as sent, or None);
    ``input_field`` (the field the texts came from, for errors); ``single``
    (it was one string, not an array)."""

    texts: list[str]
    normalize: bool = True
    truncate: bool = True
    encoding_format: str = "float"
    model: str | None = None
    input_field: str = "input"
    single: bool = False


def parse_json(body: bytes) -> dict:
    """The request's JSON object.

    Raises:
      RequestError: 400 ``body`` when it is not UTF-8 JSON or not an object.
    """
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, too deep, too long ints
        text = str(e)[:200] if isinstance(e, ValueError) else "nested too deeply"
        raise RequestError(400, "body", f"the request body is not valid JSON: {text}") from None
    if not isinstance(obj, dict):
        raise RequestError(400, "body", "the request body must be a JSON object, got "
                                        f"{_json_type(obj)}")
    return obj


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _texts(obj: dict, field: str, status: int, max_inputs: int) -> list[str]:
    if field not in obj:
        raise RequestError(status, field, f"'{field}' is required: a string or an array "
                                          "of strings")
    v = obj[field]
    if isinstance(v, str):
        _check_text(v, field, status)
        return [v]
    if not isinstance(v, list):
        raise RequestError(status, field, f"'{field}' must be a string or an array of "
                                          f"strings, got {_json_type(v)}")
    if not v:
        raise RequestError(status, field, f"'{field}' must not be an empty array")
    if len(v) > max_inputs:
        raise RequestError(413, field, f"'{field}' has {len(v)} inputs; this server takes "
                                       f"at most {max_inputs} per request")
    for i, t in enumerate(v):
        if not isinstance(t, str):
            hint = (" (token-id inputs are not supported: send text)"
                    if isinstance(t, (int, list)) and not isinstance(t, bool) else "")
            raise RequestError(status, f"{field}[{i}]", f"'{field}[{i}]' must be a string, "
                                                        f"got {_json_type(t)}{hint}")
        _check_text(t, f"{field}[{i}]", status)
    return list(v)


def _check_text(text: str, field: str, status: int) -> None:
    """JSON may carry lone UTF-16 surrogates (``"\\ud800"``), which no tokenizer
    takes: the client's error, not the server's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(status, field, f"'{field}' is not valid Unicode: {e.reason} at "
                                          f"character {e.start}") from None


def _optional(obj: dict, field: str, kind: type, status: int, default: Any) -> Any:
    v = obj.get(field)
    if v is None:
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        name = {bool: "a boolean", str: "a string", int: "an integer"}[kind]
        raise RequestError(status, field, f"'{field}' must be {name}, got {_json_type(v)}")
    return v


def openai_request(obj: dict, *, max_inputs: int, hidden_size: int) -> EmbeddingRequest:
    """``POST /v1/embeddings``'s body (OpenAI's): ``input`` a string or an
    array of strings, ``encoding_format`` ``"float"`` (default) or
    ``"base64"``, ``model`` a string (echoed as the served model's name),
    ``dimensions`` the model's size if given, ``user`` a string. Texts over
    the token limit are truncated (as sentence-transformers does).

    Raises:
      RequestError: 400 naming the field; 413 over ``max_inputs``.
    """
    texts = _texts(obj, "input", 400, max_inputs)
    single = isinstance(obj["input"], str)
    fmt = _optional(obj, "encoding_format", str, 400, "float")
    if fmt not in ("float", "base64"):
        raise RequestError(400, "encoding_format", "'encoding_format' must be 'float' or "
                                                   f"'base64', got {fmt!r}")
    model = _optional(obj, "model", str, 400, None)
    dims = _optional(obj, "dimensions", int, 400, None)
    if dims is not None and dims != hidden_size:
        raise RequestError(400, "dimensions", f"'dimensions' must be {hidden_size} (this "
                                              f"model's embedding size), got {dims}")
    _optional(obj, "user", str, 400, None)
    return EmbeddingRequest(texts, normalize=True, truncate=True, encoding_format=fmt,
                            model=model, input_field="input", single=single)


def tei_request(obj: dict, *, max_inputs: int) -> EmbeddingRequest:
    """``POST /embed``'s body (text-embeddings-inference's): ``inputs`` a
    string or an array of strings, ``normalize`` (default true), ``truncate``
    (default false: a text over the token limit is a 413),
    ``truncation_direction`` ``"Right"`` only, ``prompt_name`` null only.

    Raises:
      RequestError: 422 naming the field (TEI's status for validation); 413
        over ``max_inputs``.
    """
    texts = _texts(obj, "inputs", 422, max_inputs)
    single = isinstance(obj["inputs"], str)
    normalize = _optional(obj, "normalize", bool, 422, True)
    truncate = _optional(obj, "truncate", bool, 422, False)
    direction = _optional(obj, "truncation_direction", str, 422, "Right")
    if direction.lower() != "right":
        raise RequestError(422, "truncation_direction", "'truncation_direction' must be "
                                                        f"'Right' (the only one served), got {direction!r}")
    if obj.get("prompt_name") is not None:
        raise RequestError(422, "prompt_name", "'prompt_name' is not supported (this model "
                                               "has no prompts)")
    return EmbeddingRequest(texts, normalize=normalize, truncate=truncate,
                            input_field="inputs", single=single)
