"""Serving a test's HTTP server with a bounded life (standard library only).

Shared by the test servers in this directory (faultproxy.py,
hostile_registry.py): the server writes its port where the test reads it,
and exits by itself after its lifetime, when the test that started it goes
away, or on SIGTERM/SIGINT/SIGHUP, so no test leaves one behind.
"""

import os
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer


class Server(ThreadingHTTPServer):
    """A threaded test server for which a client going away mid-answer is
    routine (not a traceback)."""

    allow_reuse_address = True
    daemon_threads = True

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handle_error(request, client_address)


def serve(server, lifetime, port_file, log, what):
    """Serve `server` forever, bounded as above; `what` describes it in the
    log. Prints `listening PORT` and writes PORT to `port_file` (if given,
    atomically) once it listens."""
    parent = os.getppid()
    started = time.monotonic()
    port = server.server_address[1]

    def watchdog():
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                log("parent gone; exiting")
                os._exit(0)
            if time.monotonic() - started > lifetime:
                log(f"lifetime of {lifetime:g} s over; exiting")
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os._exit(0))

    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, port_file)
    print(f"listening {port}", flush=True)
    log(f"127.0.0.1:{port} {what}")
    server.serve_forever(poll_interval=0.2)
