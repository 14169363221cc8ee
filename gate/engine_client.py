"""Minimal HTTP client for an OpenAI-compatible vLLM server (stdlib only).

One streaming ``/v1/completions`` request at a time, with the prompt given as
token ids, temperature 0, and ``return_token_ids`` (vLLM 0.27.1,
``entrypoints/openai/completion/protocol.py:159``) so the gate can check that
the engine saw exactly the ids it sent and compare continuations token by
token.  TTFT is the time from sending the request to the first streamed chunk
that carries output (text or token ids).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Sequence


class ClientError(RuntimeError):
    pass


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, ConnectionError, socket.timeout, OSError) as exc:
        raise ClientError(f"GET {url}: {getattr(exc, 'reason', exc)}") from None


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    echoed_prompt_ids: list[int] | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    chunks: int = 0
    # per output token, when the request asked for ``logprobs``: the sampled token's logprob
    # and the top-k {token: logprob} (tokens as "token_id:N" with return_tokens_as_token_ids)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)

    def to_json(self, *, keep_ids: bool = True) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids if keep_ids else None, "ttft_s": self.ttft_s,
                "total_s": self.total_s, "usage": self.usage, "finish_reason": self.finish_reason,
                "chunks": self.chunks,
                "prompt_ids_echoed": None if self.echoed_prompt_ids is None else len(self.echoed_prompt_ids),
                "token_logprobs": self.token_logprobs or None, "top_logprobs": self.top_logprobs or None}


def stream_completion(base_url: str, model: str, prompt_ids: Sequence[int], *, max_tokens: int,
                      timeout: float = 600.0, extra: dict[str, Any] | None = None) -> Completion:
    """POST a streaming completion; raise :class:`ClientError` on any transport/HTTP error."""
    u = urllib.parse.urlsplit(base_url)
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
            "top_p": 1.0, "seed": 0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if extra:
        body.update(extra)
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    out = Completion()
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=data,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ClientError(f"POST /v1/completions -> HTTP {resp.status}: {resp.read(500)!r}")
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                ev = json.loads(payload)
            except ValueError:
                raise ClientError(f"bad SSE payload {payload[:120]!r}") from None
            if "error" in ev:
                raise ClientError(f"server error: {ev['error']}")
            if ev.get("usage"):
                out.usage = ev["usage"]
            for ch in ev.get("choices") or []:
                out.chunks += 1
                text = ch.get("text") or ""
                toks = ch.get("token_ids") or []
                if ch.get("prompt_token_ids") is not None:
                    out.echoed_prompt_ids = list(ch["prompt_token_ids"])
                if (text or toks) and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0
                out.text += text
                out.token_ids += list(toks)
                lp = ch.get("logprobs") or {}
                out.token_logprobs += list(lp.get("token_logprobs") or [])
                out.top_logprobs += [dict(d or {}) for d in lp.get("top_logprobs") or []]
                if ch.get("finish_reason"):
                    out.finish_reason = ch["finish_reason"]
        out.total_s = time.perf_counter() - t0
    except (OSError, http.client.HTTPException) as exc:
        raise ClientError(f"POST {base_url}/v1/completions: {exc}") from None
    finally:
        conn.close()
    if out.ttft_s is None:
        raise ClientError("stream ended without any output token")
    return out
