"""The proxy in a process of its own, served as a run serves it (ProxyServer), for tests and benches that read its
memory from outside.

    python -m tests.proxy.proxy_process --upstream http://127.0.0.1:8000/v1 [--rollouts 8] [--bodies-limit-mb 512]

Rollouts r0..r<n-1> with keys secret-0..; an in-memory recorder. Prints `port=<n>` once serving and stops on
SIGTERM. GET /test/state answers what it recorded (rollout, status, error per call) and the budget in use.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MB = 1024 * 1024


def serve(args: argparse.Namespace) -> None:
    from proxy.app import create_app
    from proxy.server import ProxyServer
    from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig

    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    for i in range(args.rollouts):
        directory.add(f"r{i}", f"secret-{i}")
    proxy = create_app(directory, recorder, UpstreamConfig(base_url=args.upstream, served_model="served-model"),
                       max_body_bytes=args.max_body_mb * MB, bodies_limit_bytes=args.bodies_limit_mb * MB)

    async def app(scope, receive, send):  # the proxy plus one test-only route reporting its state
        if scope["type"] == "http" and scope["path"] == "/test/state":
            body = json.dumps({"calls": [[c.rollout_id, c.status_code, c.error] for c in recorder.calls],
                               "in_flight": proxy.gate.in_flight, "bodies_in_use": proxy.bodies.in_use,
                               "refused": proxy.bodies.refused}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await proxy(scope, receive, send)

    server = ProxyServer(app, host="127.0.0.1", request_timeout_s=args.request_timeout_s).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"port={server.port}", flush=True)
    stop.wait()
    server.stop()


def start(upstream: str, *options: str) -> tuple[subprocess.Popen, int]:
    """Start it (in a new session, for a group kill) and wait for its port; stdout and stderr go to the parent's."""
    process = subprocess.Popen([sys.executable, "-m", "tests.proxy.proxy_process", "--upstream", upstream, *options],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = process.stdout.readline()
    if not line.startswith("port="):
        process.kill()
        raise RuntimeError(f"proxy process did not start (exit {process.wait()}): {line!r}")
    return process, int(line.strip().split("=")[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, help="the engine's OpenAI base url, ending in /v1")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts r0.. with keys secret-0..")
    parser.add_argument("--max-body-mb", type=int, default=32, help="largest request body")
    parser.add_argument("--bodies-limit-mb", type=int, default=512, help="all request bodies together")
    parser.add_argument("--request-timeout-s", type=float, default=30.0, help="deadline for a whole request")
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
