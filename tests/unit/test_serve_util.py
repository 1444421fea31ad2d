"""`harness.serve_util.VllmServer.start`: a server that lost a port race is started once more,
any other failed start is an error at once. A small Python program stands in for `vllm serve`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.serve_util import VllmServer

STAND_IN = """
import http.server, pathlib, sys
port, tries, failure = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if failure and len(tries.read_text()) == 1:
    print(failure, flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class StandIn(VllmServer):
    """Fails its first start printing `failure` (nothing: never fails), then serves /health."""

    def __init__(self, tmp: Path, failure: str) -> None:
        super().__init__("model", log_path=tmp / "serve.log", start_timeout=30)
        self.tries, self.failure = tmp / "tries", failure
        (tmp / "stand_in.py").write_text(STAND_IN)

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            str(self.tries.parent / "stand_in.py"),
            str(self.port),
            str(self.tries),
            self.failure,
        ]


@pytest.mark.parametrize(
    "failure",
    [
        "DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use",
        "ERROR: [Errno 98] error while attempting to bind on address: Address already in use",
    ],
)
def test_a_start_that_lost_a_port_race_is_tried_once_more(tmp_path: Path, failure: str):
    with StandIn(tmp_path, failure) as server:
        assert server.tries.read_text() == "xx"
        assert failure in (tmp_path / "serve.port-taken.log").read_text()  # the lost start's log, kept


def test_any_other_failed_start_is_an_error_at_once(tmp_path: Path):
    with pytest.raises(RuntimeError, match="exited with 1"), StandIn(tmp_path, "ValueError: bad argument"):
        pass
    assert (tmp_path / "tries").read_text() == "x"
