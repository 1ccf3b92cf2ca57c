"""The preflight probe: ONE small program run on every node with the node's own Python.

It is sent as `python -c <this file's text> <json args>`, so it uses only the standard
library and stays compatible with old interpreters (3.8). It prints one line,
`DTRAIN-PROBE {json}`, with everything preflight needs from the node at once. torch is
found but never imported (that takes seconds): its version comes from torch/version.py,
the very file `torch.__version__` is read from.

On the master it also holds the master port open (the listener part), answering every
connection with a token, until its stdin closes or the deadline passes; the other nodes
connect to it, which proves the port is reachable from them.
"""

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

MARK = "DTRAIN-PROBE "


def torch_info():
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"torch": None}
    root = list(spec.submodule_search_locations)[0]
    info = {"torch": "unknown", "torch_path": root, "torch_cuda": None}
    try:
        with open(os.path.join(root, "version.py")) as f:
            text = f.read()
    except OSError:
        return info
    m = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if m:
        info["torch"] = m.group(1)
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if m:
        info["torch_cuda"] = m.group(1)
    return info


def gpu_info():
    try:  # NVML (nvidia-ml-py) when installed: no subprocess, exact
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            names = []
            for i in range(count):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                names.append(name.decode() if isinstance(name, bytes) else name)
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
            return {"gpus": count, "gpu_names": names, "driver": driver, "gpu_source": "nvml"}
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            rows = [r.split(", ") for r in out.stdout.strip().splitlines() if r.strip()]
            if out.returncode == 0:
                return {"gpus": len(rows), "gpu_names": [r[0] for r in rows],
                        "driver": rows[0][1] if rows and len(rows[0]) > 1 else None, "gpu_source": "nvidia-smi"}
            return {"gpus": 0, "gpu_names": [], "driver": None, "gpu_source": "nvidia-smi",
                    "gpu_error": (out.stderr or out.stdout).strip()[:200]}
        except Exception as exc:
            return {"gpus": 0, "gpu_names": [], "driver": None, "gpu_error": str(exc)[:200]}
    return {"gpus": 0, "gpu_names": [], "driver": None, "gpu_source": None}


def run(argv):
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5)
        return out.stdout if out.returncode == 0 else ""
    except Exception:
        return ""


def local_addresses():
    """{address: interface} from `ip -o addr`."""
    addrs = {}
    for line in run(["ip", "-o", "addr", "show"]).splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[2] in ("inet", "inet6"):
            addrs[parts[3].split("/")[0]] = parts[1].split("@")[0]
    return addrs


def route_to(address):
    """(interface, source address) used to reach `address`, via the kernel's routing."""
    try:
        ip = socket.getaddrinfo(address, None)[0][4][0]
    except Exception:
        return None, None, None
    out = run(["ip", "route", "get", ip])
    dev = re.search(r"\bdev (\S+)", out)
    src = re.search(r"\bsrc (\S+)", out)
    return ip, dev.group(1) if dev else None, src.group(1) if src else None


def pick_ifname(addrs, own_ip, route_dev):
    """The interface to bind collectives to (GLOO/NCCL_SOCKET_IFNAME).

    The one holding this node's own address, when that is a real address here (on the
    master, the route to itself says "lo"); else the one the route to the master uses.
    A name that resolves to loopback on its own host (Debian's "127.0.1.1 hostname")
    is the classic trap: gloo would listen where no other node can reach it."""
    import ipaddress

    own_dev = addrs.get(own_ip) if own_ip else None
    if own_dev and not ipaddress.ip_address(own_ip).is_loopback:
        return own_dev
    if route_dev and route_dev != "lo":
        return route_dev
    return own_dev or route_dev


def timed(fn, cap):
    """(result or error string, seconds), giving up waiting after `cap` seconds."""
    box = {}

    def target():
        try:
            box["r"] = fn()
        except Exception as exc:
            box["e"] = type(exc).__name__ + ": " + str(exc)

    t0 = time.time()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(cap)
    dt = time.time() - t0
    if th.is_alive():
        return "timed out", dt
    return box.get("r", box.get("e")), dt


def name_checks(master, cap):
    hostname = socket.gethostname()
    jobs = {
        "reverse_master": lambda: socket.gethostbyaddr(master)[0],
        "own_hostname": lambda: socket.getaddrinfo(hostname, None)[0][4][0],
    }
    results = {}
    threads = []
    for key, fn in jobs.items():
        th = threading.Thread(target=lambda k=key, f=fn: results.__setitem__(k, timed(f, cap)), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(cap + 1)
    return {k: {"result": v[0], "seconds": round(v[1], 3)} for k, v in results.items()}


def tree_digest(path, limit):
    """A cheap content fingerprint: relative paths and sizes of the first `limit` entries."""
    import hashlib

    if not os.path.exists(path):
        return {"path": path, "exists": False}
    h = hashlib.sha256()
    n = 0
    if os.path.isfile(path):
        h.update(str(os.path.getsize(path)).encode())
        n = 1
    else:
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                try:
                    size = os.path.getsize(full)
                except OSError:
                    size = -1
                h.update(os.fsencode(os.path.relpath(full, path)) + f"\0{size}\n".encode())  # a name's own bytes
                n += 1
                if n >= limit:
                    break
            if n >= limit:
                break
    return {"path": path, "exists": True, "entries": n, "digest": h.hexdigest()[:16], "truncated": n >= limit}


def port_holder(port):
    out = run(["ss", "-Hltnp", "sport = :%d" % port])
    m = re.search(r'users:\(\("([^"]+)",pid=(\d+)', out)
    return "%s (pid %s)" % (m.group(1), m.group(2)) if m else None


def connect_master(address, port, token, deadline):
    last = "no attempt"
    while time.time() < deadline:
        try:
            conn = socket.create_connection((address, port), timeout=2)
        except ConnectionRefusedError as exc:
            last = str(exc)
            time.sleep(0.1)  # the master's listener may not be up yet
            continue
        except OSError as exc:  # unreachable, or silent: waiting longer will not help
            return {"ok": False, "error": str(exc)}
        with conn:
            conn.settimeout(2)
            try:
                got = conn.recv(64).decode(errors="replace").strip()
            except OSError:
                got = ""
        if got == token:
            return {"ok": True}
        return {"ok": False, "error": "something else answers on port %d" % port}
    return {"ok": False, "error": last}


def listen(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # torch's TCPStore sets SO_REUSEADDR too: a port in TIME_WAIT is not "in use" for it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("0.0.0.0", port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        return None, str(exc)
    return sock, None


def serve(sock, token, deadline):
    stop = threading.Event()

    def watch_stdin():
        try:
            sys.stdin.read()
        finally:
            stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    sock.settimeout(0.2)
    while not stop.is_set() and time.time() < deadline:
        try:
            conn, _ = sock.accept()
        except socket.timeout:
            continue
        with conn:
            conn.sendall((token + "\n").encode())
    sock.close()


def main():
    args = json.loads(sys.argv[1])
    deadline = time.time() + args["deadline_s"]
    out = {"python": sys.executable, "python_version": platform.python_version(),
           "hostname": socket.gethostname(), "platform": platform.platform()}
    sock = None
    if args.get("listen_port"):
        sock, err = listen(args["listen_port"])
        out["listen"] = {"ok": sock is not None, "error": err,
                         "holder": port_holder(args["listen_port"]) if err else None}
    out.update(torch_info())
    out.update(gpu_info())
    master = args["master_address"]
    ip, dev, src = route_to(master)
    addrs = local_addresses()
    own = args.get("own_address")
    own_ip = route_to(own)[0] if own else None
    out["ifname"] = pick_ifname(addrs, own_ip, dev)
    out["addresses"] = addrs
    out["own_ip"] = own_ip
    out["route"] = {"master_ip": ip, "dev": dev, "src": src}
    out["names"] = name_checks(master, args.get("dns_cap_s", 3.0))
    out["shared"] = [tree_digest(p, args.get("digest_limit", 20000)) for p in args.get("shared_paths", [])]
    if args.get("connect_port") and ip:
        out["connect"] = connect_master(ip, args["connect_port"], args["token"],
                                        min(deadline, time.time() + args.get("connect_s", 8)))
    out["time"] = time.time()
    sys.stdout.write(MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    if sock is not None:
        serve(sock, args["token"], deadline)


if __name__ == "__main__":
    main()
