"""Network namespaces on a tc-shaped bridge: the network of ``python -m hvd_sparse.bench network`` and ``train``.

    with Network(workers=4, rate=Rate("1gbit")) as net:     # builds it (root), tears it down on exit
        net.namespaces, net.ns_links, net.ips, net.bridge, net.bridge_ip
        link_check(net)                                       # payload bytes/s of one TCP stream n0 -> n1

The public API, also for other tools that need P shaped "hosts" on one machine:

    Network(workers, rate, prefix=None)   set-up (``setup()`` / ``__enter__``) and tear-down (``teardown()`` /
                                          ``__exit__``, idempotent, signals deferred while it runs)
    remove_stale(log=None, include_own=False)   removes namespaces, links and /etc/netns entries of earlier runs
                                          whose process is gone (call it before building a network)
    list_names()                          this machine's namespaces and links that match :data:`NAME`
    missing_requirements()                what is missing to build one (root, ``ip``, ``tc``); empty: nothing
    link_check(net, seconds)              one TCP stream through two shaped ends
    Rate, bandwidth(text), workers(text)  a tc rate in bits/s; the argparse types of ``--bandwidth``, ``--workers``
    signals_deferred(), pid_alive(pid)    used by the tear-down paths

The topology::

    root namespace:   bridge <prefix>b  10.X.Y.1/24  (+ the Horovod rendezvous server, bound to that address)
                        |                |                       |
                      veth <prefix>h0   veth <prefix>h1   ...    tbf rate RATE  (egress = the worker's download)
                        |                |
    namespace <prefix>n0: <prefix>p0 10.X.Y.10   n1: p1 .11 ...  tbf rate RATE  (egress = the worker's upload)

Every worker owns a full-duplex "NIC" of RATE in each direction (a ``tc qdisc tbf`` on both ends of its veth
pair) plugged into a non-blocking switch (the bridge). ``<prefix>`` is ``hvds<pid>`` of the building process;
``/etc/netns/<namespace>/hosts`` maps the machine's hostname to the namespace's address (see
:meth:`Network._write_hosts`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

#: device and namespace names: ``hvds<pid>`` + ``b`` (bridge), ``h<i>`` (root end of worker i's veth),
#: ``p<i>`` (its namespace end), ``n<i>`` (its namespace); at most 15 characters (IFNAMSIZ)
NAME = re.compile(r"^hvds(\d+)(b|[hpn]\d+)$")
MAX_WORKERS = 64
#: per-namespace configuration files that ``ip netns exec`` bind-mounts over /etc
ETC_NETNS = Path("/etc/netns")


class NetworkError(RuntimeError):
    """The network could not be built (missing privileges or kernel support); exit code 2."""



# -- argument types ---------------------------------------------------------------------------------------

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class Rate(int):
    """A rate in bits/s that remembers how it was written (``Rate("1gbit") == 10**9``)."""

    def __new__(cls, text):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(text).lower())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(text)
        bits = int(round(float(m.group(1)) * _UNITS[m.group(2)]))
        self = super().__new__(cls, bits)
        self.text = f"{m.group(1)}{m.group(2)}"
        return self

    def __str__(self):
        return self.text


def bandwidth(text):
    """``--bandwidth``: a tc rate in bits per second, e.g. ``1gbit``, ``500mbit``, ``100mbit``."""
    try:
        rate = Rate(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a rate in bits per second like 1gbit, 500mbit or 100mbit (units: "
            f"{', '.join(_UNITS)}), got {text!r}") from None
    if not 10**5 <= rate <= 4 * 10**11:
        raise argparse.ArgumentTypeError(f"must be between 100kbit and 400gbit, got {text!r}")
    return rate


def workers(text):
    """``--workers``: 2 <= P <= 64 (dense Horovod does nothing at P = 1)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 2 <= v <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between 2 and {MAX_WORKERS} (one network namespace per "
                                         f"worker), got {v}")
    return v



# -- the network ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def signals_deferred():
    """Ignore SIGINT/SIGTERM/SIGHUP while cleaning up (a second Ctrl-C must not leave half a network behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(cmd, check=True):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise NetworkError(f"`{' '.join(cmd)}` did not finish within 60 s") from None
    if check and proc.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed (exit code {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def missing_requirements():
    """What the network benchmark lacks on this machine (empty list: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces, veth links and tc qdiscs need CAP_NET_ADMIN; "
                       "run it with sudo)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (package {pkg})")
    return missing


def cannot_build():
    """None when this machine can build the benchmark's namespaces, else the reason: what
    :func:`missing_requirements` lists, or the error of a trial ``ip netns add`` (a sandbox may forbid it)."""
    missing = missing_requirements()
    if missing:
        return "needs " + "; ".join(missing)
    name = f"hvds{os.getpid()}n99"
    proc = _run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
        return f"`ip netns add` fails here: {(proc.stderr or proc.stdout).strip()}"
    _run(["ip", "netns", "del", name], check=False)
    return None


def list_names():
    """Network namespaces and links of this machine whose names match :data:`NAME`."""
    ns = []
    out = _run(["ip", "netns", "list"], check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if NAME.match(name):
            ns.append(name)
    links = []
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if NAME.match(name):
                links.append(name)
    return ns, links


def remove_stale(log=None, include_own=False):
    """Remove namespaces and links of earlier runs whose process is gone (another live run is left alone).

    ``include_own=True`` (before this process builds its network) also removes names with this process's pid:
    they can only be leftovers of a dead process that had the same pid."""
    ns, links = list_names()

    def dead(name):
        pid = int(NAME.match(name).group(1))
        return (include_own and pid == os.getpid()) or not pid_alive(pid)

    removed = []
    for link in sorted(links, key=lambda s: s.endswith("b")):              # veths first, then bridges
        if dead(link) and _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    for name in ns:
        if dead(name) and _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.iterdir():
            if NAME.match(d.name) and dead(d.name):
                shutil.rmtree(d, ignore_errors=True)
        _rmdir_if_empty(ETC_NETNS)
    if removed and log:
        log(f"removed leftovers of an earlier run: {', '.join(removed)}")
    return removed


def _rmdir_if_empty(path):
    try:
        path.rmdir()
    except OSError:
        pass


def _free_subnet(pid):
    """A /24 of 10.211.0.0/16 that no address or route of this machine uses (start at pid % 256)."""
    used = _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout + \
        _run(["ip", "-4", "addr", "show"], check=False).stdout
    for i in range(256):
        third = (pid + i) % 256
        if f"10.211.{third}." not in used:
            return f"10.211.{third}"
    raise NetworkError("no free /24 in 10.211.0.0/16 for the benchmark network")


class Network:
    """P network namespaces on a bridge, each behind a veth pair shaped with ``tbf rate`` in both directions.

    Use as a context manager; :meth:`teardown` is idempotent and removes whatever :meth:`setup` created.

    Args:
        workers (int): number of namespaces P.
        rate (int): bits per second of each direction of each worker's link.
        prefix (str): name prefix, ``hvds<pid>`` (see :data:`NAME`).
    """

    def __init__(self, workers, rate, prefix=None):
        self.workers, self.rate = int(workers), int(rate)
        self.prefix = prefix or f"hvds{os.getpid()}"
        self.bridge = f"{self.prefix}b"
        self.namespaces = [f"{self.prefix}n{i}" for i in range(self.workers)]
        self.host_links = [f"{self.prefix}h{i}" for i in range(self.workers)]
        self.ns_links = [f"{self.prefix}p{i}" for i in range(self.workers)]
        if len(self.host_links[-1]) > 15:
            raise NetworkError(f"interface name {self.host_links[-1]!r} is longer than 15 characters")
        self.subnet = None
        self.bridge_ip = None
        self.ips = []
        self._created_ns, self._created_links, self._created_etc = [], [], []

    def tbf(self):
        """The tbf parameters: burst of ~1 ms at the rate (>= 64 KiB, above a 64 KiB GSO packet), queue of
        200 ms (no tail drops while one worker receives from several at once)."""
        byte_rate = self.rate / 8
        burst = max(64 * 1024, int(byte_rate / 1000))
        return ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "200ms"]

    def setup(self):
        self.subnet = _free_subnet(os.getpid())
        self.bridge_ip = f"{self.subnet}.1"
        self.ips = [f"{self.subnet}.{10 + i}" for i in range(self.workers)]
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._created_links.append(self.bridge)
        _run(["ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for ns, host, peer, ip in zip(self.namespaces, self.host_links, self.ns_links, self.ips):
            _run(["ip", "netns", "add", ns])
            self._created_ns.append(ns)
            _run(["ip", "link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns])
            self._created_links.append(host)
            _run(["ip", "link", "set", host, "master", self.bridge])
            _run(["ip", "link", "set", host, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", peer])
            _run(["ip", "-n", ns, "link", "set", peer, "up"])
            _run(["tc", "qdisc", "replace", "dev", host, "root", *self.tbf()])                    # download
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", peer, "root", *self.tbf()])  # upload
            self._write_hosts(ns, ip)
        return self

    def _write_hosts(self, ns, ip):
        """``/etc/netns/<ns>/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``): the machine's hostname
        resolves to the namespace's own address. Horovod 0.28.1 builds the Gloo device of every process set,
        the global one included, from the hostname instead of ``HOROVOD_GLOO_IFACE``
        (``GlooContext::InitializeForProcessSet`` reads its own, empty, ``gloo_iface_``); with the usual
        ``127.0.0.1 <hostname>`` the ranks would advertise 127.0.0.1 to each other and fail to connect."""
        d = ETC_NETNS / ns
        d.mkdir(parents=True, exist_ok=True)
        self._created_etc.append(d)
        (d / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{ip} {socket.gethostname()}\n")

    def teardown(self):
        """Delete the veth pairs (both ends go), the namespaces and the bridge; returns names that remain."""
        for link in [lk for lk in self._created_links if lk != self.bridge]:
            _run(["ip", "link", "del", link], check=False)
        for ns in self._created_ns:
            _run(["ip", "netns", "del", ns], check=False)
        if self.bridge in self._created_links:
            _run(["ip", "link", "del", self.bridge], check=False)
        for d in self._created_etc:
            shutil.rmtree(d, ignore_errors=True)
        _rmdir_if_empty(ETC_NETNS)
        self._created_links, self._created_ns, self._created_etc = [], [], []
        ns, links = list_names()
        return [x for x in ns + links if x.startswith(self.prefix) and NAME.match(x).group(1) ==
                self.prefix[4:]]

    def __enter__(self):
        try:
            return self.setup()
        except BaseException:
            with signals_deferred():
                self.teardown()
            raise

    def __exit__(self, *exc):
        with signals_deferred():
            left = self.teardown()
        if left:
            warnings.warn(f"hvd_sparse.bench network: could not remove {', '.join(left)}; remove them with "
                          "`ip netns del` / `ip link del`", RuntimeWarning, stacklevel=2)


_LINK_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
s.settimeout(60); c, _ = s.accept(); c.settimeout(60)
want, got, t0, first = int(sys.argv[2]), 0, None, 0
buf = bytearray(1 << 20)
while got < want:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:
        t0 = time.perf_counter(); first = k
    got += k
print(got, first, time.perf_counter() - t0, flush=True)
"""

_LINK_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.sendall(bytes(int(sys.argv[3]))); c.close()
"""


def link_check(net, seconds=0.5):
    """Payload bytes/s of one TCP stream from namespace 0 to namespace 1 (about ``seconds`` of traffic)."""
    nbytes = max(1 << 20, int(net.rate / 8 * seconds))
    server = subprocess.Popen(["ip", "netns", "exec", net.namespaces[1], sys.executable, "-c", _LINK_SERVER,
                               net.ips[1], str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise NetworkError(f"link check: the server in {net.namespaces[1]} did not start: "
                               f"{server.stderr.read().strip()}")
        client = subprocess.run(["ip", "netns", "exec", net.namespaces[0], sys.executable, "-c", _LINK_CLIENT,
                                 net.ips[1], port, str(nbytes)], capture_output=True, text=True, timeout=120)
        out, err = server.communicate(timeout=120)
        if client.returncode != 0 or server.returncode != 0:
            raise NetworkError(
                f"link check: namespace {net.namespaces[0]} ({net.ips[0]}) could not send to "
                f"{net.namespaces[1]} ({net.ips[1]}) over the bridge {net.bridge}: {client.stderr.strip()} "
                f"{err.strip()} (a firewall on bridged traffic, e.g. br_netfilter with a DROP policy, does this)")
        got, first, secs = out.split()
        return (int(got) - int(first)) / float(secs) if float(secs) > 0 else None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
