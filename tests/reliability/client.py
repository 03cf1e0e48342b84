"""HTTP helpers of the reliability tests: SSE requests that may hang up at a chosen point, raw
socket requests, and the engine's idle-state (leak) check."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

MODEL = "tiny"
KEY = "rel-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Result:
    status: int
    text: str = ""  # reasoning + "|" + content for chat, the text for completions
    finish: str | None = None
    error: dict | None = None
    events: int = 0  # content-bearing SSE events seen
    completion_tokens: int | None = None
    body: Any = None
    cut: bool = False  # the client hung up on purpose
    raw: list[str] = field(default_factory=list)


def _delta_text(chunk: dict, chat: bool) -> tuple[str, str]:
    if not chunk.get("choices"):
        return "", ""
    c = chunk["choices"][0]
    if not chat:
        return "", c.get("text") or ""
    d = c.get("delta") or {}
    return d.get("reasoning_content") or "", d.get("content") or ""


def stream(client: httpx.Client, url: str, path: str, body: dict, *,
           cut_after: int | None = None) -> Result:
    """POST with stream=true; hang up after `cut_after` content events (0: right after the
    headers and role chunk, i.e. during prefill), else read to [DONE]."""
    chat = path.endswith("chat/completions")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    reasoning, content = "", ""
    with client.stream("POST", url + path, json=body, headers=AUTH) as r:
        res = Result(r.status_code)
        if r.status_code != 200:
            r.read()
            res.body = r.json()
            return res
        if cut_after == 0:
            res.cut = True
            return res
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = chunk["error"]
                break
            if chunk.get("usage"):
                res.completion_tokens = chunk["usage"]["completion_tokens"]
            r_, c_ = _delta_text(chunk, chat)
            reasoning, content = reasoning + r_, content + c_
            for ch in chunk.get("choices") or []:
                res.finish = ch.get("finish_reason") or res.finish
            if r_ or c_:
                res.events += 1
                if cut_after is not None and res.events >= cut_after:
                    res.cut = True
                    break
    res.text = f"{reasoning}|{content}" if chat else content
    return res


def complete(client: httpx.Client, url: str, path: str, body: dict) -> Result:
    """POST without streaming."""
    r = client.post(url + path, json={**body, "stream": False}, headers=AUTH)
    res = Result(r.status_code, body=r.json())
    if r.status_code != 200:
        return res
    c = res.body["choices"][0]
    if path.endswith("chat/completions"):
        m = c["message"]
        res.text = f"{m.get('reasoning_content') or ''}|{m.get('content') or ''}"
    else:
        res.text = c["text"]
    res.finish = c["finish_reason"]
    res.completion_tokens = res.body["usage"]["completion_tokens"]
    return res


def hang_up(url: str, path: str, body: dict, after_s: float) -> None:
    """Send a non-streaming request on a raw socket and close it after `after_s` seconds."""
    u = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + payload)
        time.sleep(after_s)


def raw_request(url: str, data: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send `data` (a whole HTTP/1.1 request) and return (status, body) of the reply."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while True:
            try:
                part = s.recv(65536)
            except TimeoutError:
                break
            if not part:
                break
            buf += part
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep:
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    head, _, rest = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return status, rest
