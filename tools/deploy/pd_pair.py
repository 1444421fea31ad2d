"""A prefill/decode pair on one machine: two `vllm serve` instances and a proxy in front of them.

    python -m tools.deploy.pd_pair MODEL [--port 8000] [--storage DIR] [--server-env NAME=VALUE]
        [-- VLLM_SERVE_ARGS...]

The prefill instance runs vLLM's `ExampleConnector` as `kv_producer`, the decode instance as
`kv_consumer`, both on one storage folder (the connector writes each prompt's KV there, one file
per layer, and the consumer reads it). The proxy on `--port` serves `/v1/completions` and
`/v1/chat/completions`: it sends a request to the prefill instance with one output token, then to
the decode instance as the client sent it, and returns the decode instance's answer (streamed if
asked). With the chunk cache on (the default once the patches are applied) the prefill instance
serves chunked prompts from its pool, and the decode instance loads their whole KV, documents
included, from what the prefill instance wrote (`ChunkCacheMultiConnector`).

`ExampleConnector` is vLLM's reference connector for P/D and the one that runs on a CPU: it moves
KV through files, keyed by the prompt's token ids. NIXL and Mooncake's transfer engine move it
between devices and need them; the chunk cache treats every `kv_consumer` connector alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from harness.serve_util import VllmServer, env_assignment

ROUTES = ("/v1/completions", "/v1/chat/completions")
PREFILL_ONLY = {"max_tokens": 1, "stream": False, "n": 1}
"""What the prefill instance is asked for: the prompt's KV (and one token nobody reads)."""
NOT_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens", "best_of")


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill instance gets it."""
    return {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL} | PREFILL_ONLY


def connector_config(role: str, storage: Path) -> str:
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    )


@contextlib.contextmanager
def pd_servers(
    model: str | Path,
    storage: Path,
    serve_args: Sequence[str] = (),
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[VllmServer, VllmServer]]:
    """The prefill and the decode instance (`env`: more environment for both), started one after
    the other, stopped on exit."""
    servers = []
    try:
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            log = log_dir / f"{name}.log" if log_dir else None
            args = [*serve_args, "--kv-transfer-config", connector_config(role, storage)]
            servers.append(VllmServer(model, args, env=env, log_path=log).start())
            print(f"{name} instance ({role}): {servers[-1].url} (log {servers[-1].log_path})", flush=True)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


def make_proxy(prefill_url: str, decode_url: str):
    """The proxy's aiohttp application."""
    import aiohttp
    from aiohttp import web

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(prefill_url + request.path, json=prefill_body(body)) as first:
            if first.status != 200:  # a refused request is refused by the prefill instance
                refusal = await first.read()
                return web.Response(status=first.status, body=refusal, content_type="application/json")
        async with session.post(decode_url + request.path, json=body) as answer:
            response = web.StreamResponse(status=answer.status)
            response.content_type = answer.content_type
            await response.prepare(request)
            async for piece in answer.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        session = request.app["session"]
        for url in (prefill_url, decode_url):
            async with session.get(url + "/health") as r:
                if r.status != 200:
                    return web.Response(status=503, text=f"{url} is not healthy")
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        async with request.app["session"].get(decode_url + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def session_context(app: web.Application):
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_context)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    for route in ROUTES:
        app.router.add_post(route, forward)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port (default 8000)")
    parser.add_argument("--storage", type=Path, help="the KV folder (default: a new temporary one)")
    parser.add_argument("--log-dir", type=Path, help="the instances' logs (default: temporary files)")
    parser.add_argument(
        "--server-env",
        action="append",
        type=env_assignment,
        metavar="NAME=VALUE",
        help="one more environment variable for both instances (repeat)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, serve_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    from aiohttp import web

    with contextlib.ExitStack() as stack:
        storage = args.storage or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pd-kv-")))
        prefill, decode = stack.enter_context(
            pd_servers(args.model, storage, serve_args, args.log_dir, dict(args.server_env or []))
        )
        print(f"P/D pair ready: proxy on http://127.0.0.1:{args.port}, KV in {storage}", flush=True)
        web.run_app(make_proxy(prefill.url, decode.url), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
