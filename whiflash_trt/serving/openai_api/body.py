"""Reading a request body within ServerLimits. Every refusal is an APIError, so the client gets an OpenAI error
object: 415 for a body not declared JSON, 413 for one over the size cap, 400 for one that is not JSON the server can
hold (bad UTF-8, a lone surrogate, nesting deeper than Python's recursion limit).
"""
from __future__ import annotations

import json

from starlette.requests import Request as HTTPRequest

from whiflash_trt.serving.openai_api.limits import ServerLimits
from whiflash_trt.serving.openai_api.protocol import APIError


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(http: HTTPRequest, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it passes `max_bytes`: by its Content-Length, or while it is read."""
    declared = http.headers.get("content-length")
    too_large = APIError(f"the request body is larger than this server's limit of {max_bytes} bytes",
                         code="request_too_large", status=413)
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


async def read_json(http: HTTPRequest, limits: ServerLimits):
    """The request's JSON value, within `limits`."""
    if not _is_json(http.headers.get("content-type")):
        raise APIError(f"the request body must be JSON sent as Content-Type: application/json, got "
                       f"{http.headers.get('content-type')!r}", code="unsupported_media_type", status=415)
    raw = await read_body(http, limits.max_body_bytes)
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode("utf-8")   # a lone surrogate (\ud800) cannot be encoded
    except RecursionError:
        raise APIError("the request body's JSON is nested too deeply", code="invalid_json") from None
    except UnicodeError as e:
        raise APIError(f"the request body is not valid UTF-8: {e}", code="invalid_json") from None
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    return body
