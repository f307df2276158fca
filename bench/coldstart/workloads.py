"""The cold-start benchmark's workloads: what each container runs, and when
it is ready (its first useful output): "hello" on stdout, the first HTTP 200
(nginx) or +PONG (redis) of a probe polling every 10 ms on 127.0.0.1."""

import json
import os
import select
import socket
import time

WORKLOADS = ("python", "nginx", "redis", "readall", "datasci", "node")
# workloads whose first useful output is "hello" on stdout
STDOUT_WORKLOADS = ("python", "readall", "datasci", "node")
# Heavy workloads (issue 29), each on its own image: a tag of the layout that
# scripts/heavy-image.sh builds. They run with HEAVY_VARIANTS only; "local"
# is the limit: the same start from the source image unpacked on local disk
# (umoci), page cache dropped.
HEAVY = ("datasci", "node")
HEAVY_VARIANTS = ("containerd", "lamina", "lamina-boot", "local", "lamina-nopredict", "lamina-boot-ra32", "lamina-boot-ra128",
                  "lamina-static", "lamina-all", "lamina-base", "lamina-rests", "lamina-base-boot",
                  "proxy", "faults", "faults-nohedge")
HEAVY_LAYOUT = "/var/cache/lamina-test/heavy-oci"
DATASCI_IMPORTS = "numpy, pandas, scipy.stats, sklearn.linear_model, pyarrow, statsmodels.api, matplotlib.pyplot"
NODE_REQUIRES = ["express", "lodash", "moment", "axios", "@babel/core", "rxjs", "date-fns", "typescript"]
# readall (every file of the image read once) has no boot set of its own and
# runs only on links of 100mbit and more: at 10mbit each start is minutes
READALL_MIN_BPS = 100 * 10**6
READY_TIMEOUT = 300
NGINX_CONF_IN = "/etc/nginx/coldstart.conf"
NGINX_CONF = """daemon off;
worker_processes 1;
pid /run/nginx-coldstart.pid;
error_log stderr warn;
events {{ worker_connections 64; }}
http {{
    include /etc/nginx/mime.types;
    access_log off;
    server {{
        listen 127.0.0.1:{port};
        root /var/www/html;
        index index.nginx-debian.html;
    }}
}}
"""


def args(workload, port):
    """The container's command line."""
    if workload == "python":
        return ["python3", "-c", 'print("hello")']
    if workload == "datasci":
        return ["python3", "-c", f'import matplotlib; matplotlib.use("Agg"); import {DATASCI_IMPORTS}; print("hello")']
    if workload == "node":
        requires = "".join(f"require({json.dumps(m)});" for m in NODE_REQUIRES)
        return ["sh", "-c", f"cd /opt/app && LD_LIBRARY_PATH=/opt/node/lib exec /opt/node/bin/node -e "
                            f"'{requires} console.log(\"hello\")'"]
    if workload == "readall":
        return ["sh", "-c", "find / -xdev -type f -exec cat {} + >/dev/null; echo hello"]
    if workload == "nginx":
        return ["nginx", "-c", NGINX_CONF_IN]
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "no"]


def workload_programs(workload):
    """The programs a workload's container starts (`lamina convert --boot-exec`)."""
    return {"python": ["python3"], "datasci": ["python3"], "node": ["sh", "/opt/node/bin/node"],
            "nginx": ["nginx"], "redis": ["redis-server"]}.get(workload, [])


def nginx_conf(path, port):
    """nginx's configuration for a start (bound into its container at NGINX_CONF_IN)."""
    with open(path, "w") as f:
        f.write(NGINX_CONF.format(port=port))
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rate_bps(rate):
    n, unit = rate[:-4], rate[-4:]
    return int(n) * {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[unit]


# a server's probe: what it sends, and how the answer of a ready server starts
PROBES = {"nginx": (b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", b"HTTP/1.1 200"),
          "redis": (b"PING\r\n", b"+PONG")}


def probe(port, request, reply):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(request)
            return s.recv(64).startswith(reply)
    except OSError:
        return False


def wait_ready(workload, proc, port, timeout=READY_TIMEOUT, netns=None):
    """Blocks until the workload's first useful output; returns time.perf_counter() then.
    With netns (a harness Namespace), the servers' probe connects from inside it."""
    deadline = time.monotonic() + timeout
    if workload in STDOUT_WORKLOADS:
        buf = b""
        fd = proc.stdout.fileno()
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"container exited without output (rc {proc.wait()})")
                buf += chunk
                if b"hello\n" in buf:
                    return time.perf_counter()
        raise TimeoutError(f"no output within {timeout} s")
    request, reply = PROBES["nginx" if workload == "nginx" else "redis"]
    while time.monotonic() < deadline:
        if (netns.call(probe, port, request, reply) if netns else probe(port, request, reply)):
            return time.perf_counter()
        if proc.poll() is not None:
            raise RuntimeError(f"container exited before it answered (rc {proc.returncode})")
        time.sleep(0.01)
    raise TimeoutError(f"no answer within {timeout} s")
