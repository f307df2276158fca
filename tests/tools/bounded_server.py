"""Serving a test's HTTP server with a bounded life (standard library only).

Shared by the test servers in this directory (faultproxy.py,
hostile_registry.py): the server writes its port where the test reads it,
and exits by itself after its lifetime, when the test that started it goes
away, or on SIGTERM/SIGINT/SIGHUP, so no test leaves one behind.
"""

import os
import signal
import threading
import time


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
