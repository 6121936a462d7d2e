"""What the HTTP front end accepts before a request reaches the engine (whiflash-serve --openai's limit options).
body.read_json applies the body's limits, protocol the prompt's and the stop strings', the app the queue's and the
key."""
from __future__ import annotations

import hmac
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 * 2**20        # a request body's size (413 above)
    max_prompt_chars: int = 200_000        # a prompt's characters (all of a chat's messages), checked before tokenizing
    max_stop_chars: int = 256              # each stop string's characters (their count is protocol.MAX_STOP_STRINGS)
    max_queue: int = 64                    # requests waiting for the engine; one more is answered 429
    chat_max_tokens: int = 512             # a chat request's max_tokens when it names none (capped by the context)
    api_key: str | None = None             # when set, every route but /health needs `Authorization: Bearer KEY`

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_stop_chars", "max_queue", "chat_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api-key must be non-empty")

    def authorized(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries the key (constant-time comparison)."""
        if self.api_key is None:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())
