"""`vllm-chunk-cache-eval` against stand-in servers: what an unpatched vLLM, a server with the
chunk cache off and one that wants an API key answer, and what the command makes of it. (An
unpatched `vllm serve` cannot be started in this environment: the installed vLLM is patched.
The stand-in answers a chunked token-id prompt as vLLM 0.23 does without the patches: its
`vllm_xargs` values are scalars, so a `chunk_spans` object is a 400 naming `vllm_xargs`.) The
real server's answers, chunk cache on and off: `tests/server/test_eval_cli.py`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_ascend_chunk.eval import cli, client

UNPATCHED_400 = {
    "error": {
        "message": "1 validation error for CompletionRequest\nvllm_xargs.chunk_spans.str\n  Input should "
        "be a valid string [type=string_type, input_value={'sys_len': 3, 'chunk_lens': [4]}, "
        "input_type=dict]",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
METRICS = '# HELP vllm:request_success_total x\nvllm:request_success_total{finished_reason="length"} %d.0\n'


def stand_in(kind: str):
    """A server answering /v1/models, /tokenize, /metrics and /v1/completions as `kind` would:
    "unpatched" vLLM, "off" (patched, chunk cache off), "key" (wants an API key)."""

    done = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, body) -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if kind == "key" and self.headers.get("Authorization") != "Bearer right":
                return self.reply(401, {"error": "Unauthorized"})
            if self.path == "/v1/models":
                return self.reply(200, {"data": [{"id": "m", "max_model_len": 4096}]})
            if self.path == "/metrics":
                return self.reply(200, METRICS % done[0])
            self.reply(404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                return self.reply(200, {"tokens": [1, 2, 3, 4] if "prompt" in body else [1, 2, 9, 3]})
            if self.path == "/v1/completions":
                if kind == "unpatched" and isinstance(body.get("vllm_xargs", {}).get("chunk_spans"), dict):
                    return self.reply(400, UNPATCHED_400)
                done[0] += 1
                return self.reply(200, {"choices": [{"text": "x"}]})
            self.reply(404, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    ("kind", "argv", "problem", "fix"),
    [
        ("unpatched", [], "not patched for the chunk cache", "vllm-chunk-cache-patch"),
        ("off", [], "the chunk cache is off on this server", "VLLM_ENABLE_CHUNK_CACHE=1"),
        ("key", [], "wants an API key (none given)", "--api-key"),
        ("key", ["--api-key", "wrong"], "wants an API key (a wrong one was given)", "--api-key"),
    ],
)
def test_what_the_server_is_is_detected_and_nothing_is_written(tmp_path, capsys, kind, argv, problem, fix):
    server = stand_in(kind)
    out = tmp_path / "eval.json"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        rc = cli.main(["--base-url", url, "--model", "m", "--builtin", "2", "--out", str(out), *argv])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert rc == 2 and problem in err and "fix: " in err and fix in err.split("fix: ", 1)[1]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_metrics_text_is_summed_over_labels_and_kept_by_source():
    text = (
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 5.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 7.0\n'
        'vllm:chunk_cache_hits_total{engine="0"} 2.0\nvllm:chunk_cache_hits_total{engine="1"} 1.0\n'
        "# TYPE x counter\n"
    )
    m = client.parse_metrics(text)
    assert m["vllm:prompt_tokens_by_source_total"] == 12.0 and m[client.COMPUTED] == 5.0
    assert m["vllm:chunk_cache_hits_total"] == 3.0


def test_the_command_imports_neither_vllm_nor_torch():
    code = "import sys, vllm_ascend_chunk.eval.cli; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_api_key_is_left_out_of_the_recorded_command():
    assert cli.command_line(["--api-key", "s3cret", "--model", "m", "--api-key=x"]) == (
        "vllm-chunk-cache-eval --api-key KEY --model m --api-key=KEY"
    )
