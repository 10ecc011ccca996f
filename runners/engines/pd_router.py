"""The router in front of a disaggregated vLLM deployment (runners.engines.vllm_pd starts it).

Each completion request goes, in arrival order, to the next prefill instance and the next
decode instance (round-robin on both, the policy runners/sim/router.py models and vLLM's
disaggregated proxies use): first to the prefill one with max_tokens 1, not streamed, which
computes the prompt's KV cache and hands it to the connector; then the original request, as
it came, to the decode one, which loads that KV cache instead of computing it and generates
the answer, streamed back unchanged. The prefill request also carries vLLM's
`kv_transfer_params` asking for a remote decode, and the decode request the prefill answer's
`kv_transfer_params` when it has any (what NixlConnector needs; ExampleConnector ignores
both). A prefill that fails is the request's answer (its status and body); the decode
instance is then not asked.

Other requests: GET /health answers 200 once the router listens; any other path goes to the
first decode instance.

Standalone (standard library and httpx only), so any Python with httpx runs it:
    python pd_router.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://...
SIGTERM or SIGINT stop it; it prints how many requests each instance got.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import sys
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import httpx

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_BODY = 64 << 20


class BadRequest(Exception):
    pass


class _Request:
    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes):
        self.method, self.path, self.headers, self.body = method, path, headers, body

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


async def read_request(reader: asyncio.StreamReader) -> _Request | None:
    """One HTTP/1.1 request (a body by Content-Length); None at the end of the connection."""
    line = await reader.readline()
    if not line.strip():
        return None
    try:
        method, target, _version = line.decode("latin-1").split()
    except ValueError:
        raise BadRequest(f"bad request line {line[:100]!r}") from None
    headers: dict[str, str] = {}
    while True:
        raw = await reader.readline()
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise BadRequest("a chunked request body: send Content-Length")
    length = int(headers.get("content-length", "0") or 0)
    if length > MAX_BODY:
        raise BadRequest(f"a body of {length} bytes, above {MAX_BODY}")
    body = await reader.readexactly(length) if length else b""
    return _Request(method.upper(), target.split("?", 1)[0], headers, body)


def _head(status: int, content_type: str, length: int | None) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Status"
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{framing}\r\n\r\n"
    ).encode("latin-1")


async def _send(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str) -> None:
    writer.write(_head(status, content_type, len(body)) + body)
    await writer.drain()


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "router_error"}}).encode()


class Router:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout_s: float):
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self.first_decode = decode[0]
        self.counts = dict.fromkeys([*prefill, *decode], 0)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    def pick(self) -> tuple[str, str]:
        """The next prefill and the next decode instance, in turn."""
        prefill, decode = next(self._prefill), next(self._decode)
        self.counts[prefill] += 1
        self.counts[decode] += 1
        return prefill, decode

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    break
                await self.answer(request, writer)
                if not request.keep_alive:
                    break
        except BadRequest as error:
            with contextlib.suppress(ConnectionError):
                await _send(writer, 400, _error(str(error)), "application/json")
        except (ConnectionError, asyncio.IncompleteReadError, httpx.HTTPError):
            pass  # the client left, or an upstream failed mid-stream: the answer ends here
        finally:
            writer.close()

    async def answer(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        if request.method == "GET" and request.path == "/health":
            await _send(writer, 200, b"", "text/plain")
        elif request.method == "POST" and request.path in COMPLETIONS:
            await self.complete(request, writer)
        else:
            await self.forward(self.first_decode, request, writer)

    async def forward(self, base: str, request: _Request, writer: asyncio.StreamWriter) -> None:
        try:
            response = await self.client.request(
                request.method,
                base + request.path,
                content=request.body,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
        except httpx.HTTPError as error:
            await _send(writer, 502, _error(f"{base}: {error!r}"), "application/json")
            return
        content_type = response.headers.get("content-type", "application/json")
        await _send(writer, response.status_code, response.content, content_type)

    async def complete(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        try:
            body = json.loads(request.body)
        except ValueError as error:
            raise BadRequest(f"the body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body is not a JSON object")
        prefill, decode = self.pick()
        first: dict[str, Any] = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": REMOTE_DECODE,
        }
        for key in ("stream_options", "min_tokens"):  # one token: no room for a minimum
            first.pop(key, None)
        if "max_completion_tokens" in body:
            first["max_completion_tokens"] = 1
        try:
            done = await self.client.post(prefill + request.path, json=first)
        except httpx.HTTPError as error:
            await _send(writer, 502, _error(f"prefill {prefill}: {error!r}"), "application/json")
            return
        if done.status_code != 200:
            content_type = done.headers.get("content-type", "application/json")
            await _send(writer, done.status_code, done.content, content_type)
            return
        params = _transfer_params(done)
        content = request.body if params is None else json.dumps(body | params).encode()
        await self.stream(decode + request.path, content, writer)

    async def stream(self, url: str, content: bytes, writer: asyncio.StreamWriter) -> None:
        """POST `content` to `url`; its answer goes back as it comes (chunked)."""
        headers = {"content-type": "application/json"}
        started = False
        try:
            async with self.client.stream("POST", url, content=content, headers=headers) as answer:
                content_type = answer.headers.get("content-type", "application/json")
                writer.write(_head(answer.status_code, content_type, None))
                started = True
                async for chunk in answer.aiter_raw():
                    if chunk:
                        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        await writer.drain()
        except httpx.HTTPError as error:
            if started:  # the answer is cut short: the connection closes unfinished
                raise
            await _send(writer, 502, _error(f"decode {url}: {error!r}"), "application/json")
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _transfer_params(response: httpx.Response) -> dict[str, Any] | None:
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return {"kv_transfer_params": params} if params else None


async def run(host: str, port: int, router: Router) -> None:
    server = await asyncio.start_server(router.serve, host, port, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"pd-router listening on http://{host}:{port}", flush=True)
    await stop.wait()
    server.close()
    print(f"pd-router stopping; requests per instance: {json.dumps(router.counts)}", flush=True)
    await router.client.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", required=True, help="a prefill server URL")
    parser.add_argument("--decode", action="append", required=True, help="a decode server URL")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds of silence")
    args = parser.parse_args(argv)
    prefill = [url.rstrip("/") for url in args.prefill]
    decode = [url.rstrip("/") for url in args.decode]
    print(f"pd-router: prefill {prefill}, decode {decode}, round-robin on both", flush=True)
    asyncio.run(run(args.host, args.port, Router(prefill, decode, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
