"""Runs first inside a harness's sandbox: its limits, a relay to the proxy, then the harness itself.

Standalone on purpose (standard library only, no Django, no project imports): sandbox.isolation starts it by path
inside bubblewrap, where the network namespace holds nothing but loopback. It listens on the proxy's own
127.0.0.1:<port> (so the harness's base URL stays what the proxy gave it) and forwards each connection to the
unix socket the worker bound into the sandbox, which leads to the proxy and nowhere else.

argv: --listen HOST:PORT --socket PATH --fsize BYTES --nproc N [--as BYTES] -- harness argv...
(--listen and --socket may be empty: no relay; --nproc 0: no process-count limit; --as: the address-space limit
where no memory cgroup caps the sandbox, 0 or absent: none.)
Exit status: the harness's own, 128 + N when a signal N ended it.
"""
import os
import resource
import socket
import sys
import threading

CHUNK = 65536


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _bridge(conn: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        conn.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, conn), daemon=True)
    back.start()
    _pump(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_bridge, args=(conn, path), daemon=True).start()


def _listen(where: str) -> socket.socket | None:
    host, _, port = where.rpartition(":")
    try:
        return socket.create_server((host, int(port)), backlog=256)
    except OSError as exc:
        sys.stderr.write(f"lightning sandbox: the proxy relay could not listen on {where} ({exc}); "
                         "the harness has no network\n")
        return None


def main(argv: list[str]) -> None:
    split = argv.index("--")
    opts = dict(zip(argv[:split:2], argv[1:split:2]))
    command = argv[split + 1:]
    fsize, nproc = int(opts["--fsize"]), int(opts["--nproc"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    address_space = int(opts.get("--as") or 0)
    if address_space > 0:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    listener = _listen(opts["--listen"]) if opts.get("--listen") and opts.get("--socket") else None
    pid = os.fork()  # before any thread starts
    if pid == 0:
        if listener is not None:
            listener.close()
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            sys.stderr.write(f"harness could not start: {exc}\n")
            os._exit(127)
    if listener is not None:
        threading.Thread(target=_serve, args=(listener, opts["--socket"]), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    sys.stdout.flush()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
