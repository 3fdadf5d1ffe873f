"""A cluster of ssh "hosts" on this machine, for real multi-host ``horovodrun`` jobs.

    with ssh_cluster(hosts=2, rate="1gbit") as c:
        subprocess.run(["horovodrun", "-np", "4", "-H", f"{c.ips[0]}:2,{c.ips[1]}:2", "--gloo",
                        "--ssh-identity-file", c.key, ...], env=c.env(...))

Every host is a network namespace of :class:`hvd_sparse.bench.network.Network` (a veth pair shaped with ``tc tbf``
in both directions, on a bridge in the root namespace) running its own ``sshd`` that accepts one key made for the
run. ``horovodrun`` runs in the root namespace and reaches the hosts by IP address, over ssh, exactly as it
reaches remote machines: it checks ssh, discovers the interfaces the hosts share, starts its rendezvous server on
the launcher's address on that interface and starts each rank with ``ssh <host> 'cd <cwd>; <env> <command>'``
(same Python, same files: the hosts share this machine's filesystem, as a cluster shares its home directories).

Two things a real cluster has that the namespaces are given here:

* the same interface name on every host and on the launcher (Horovod takes the interfaces common to all of them,
  and its rendezvous address is the launcher's address on the first one): each namespace's end of its veth is
  renamed to the bridge's name, so ``<bridge>`` is that common interface (the launcher's address on it is the
  bridge's);
* a host-key policy: ``ssh`` is called through a wrapper at the front of ``PATH`` that adds ``-F <config>``
  (no known_hosts file is read or written, nothing of root's ``~/.ssh`` is touched).

Everything is removed on exit, also after an error: every process left in the namespaces (the sshds and any rank a
failed job left behind) is killed, then the namespaces, links and files go.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvd_sparse.bench.netns import Network, Rate, _run, cannot_build, list_names, remove_stale

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")          # sshd refuses to start without its privilege-separation directory


def why_not():
    """None if this machine can build the cluster, else the reason (for ``pytest.mark.skipif``)."""
    why = cannot_build()
    if why:
        return why
    for tool, pkg in ((SSHD, "openssh-server"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")):
        if not (os.path.exists(tool) or shutil.which(tool)):
            return f"needs `{tool}` (Debian package {pkg}; scripts/setup_env.sh installs it)"
    return None


class Cluster:
    """What :func:`ssh_cluster` yields: ``ips`` (one per host), ``key`` (the private key), ``iface`` (the
    interface name every host and the launcher share), ``bin`` (the directory of the ``ssh`` wrapper)."""

    def __init__(self, net, tmp):
        self.net, self.tmp = net, Path(tmp)
        self.ips = list(net.ips)
        self.namespaces = list(net.namespaces)
        self.iface = net.bridge
        self.key = str(self.tmp / "id_ed25519")
        self.bin = str(self.tmp / "bin")

    def env(self, base=None, **extra):
        """``base`` (default ``os.environ``) with the ssh wrapper first on ``PATH``."""
        env = dict(os.environ if base is None else base, **extra)
        env["PATH"] = f"{self.bin}:{env.get('PATH', '')}"
        return env

    def logins(self, i):
        """Public-key logins host ``i``'s sshd has accepted so far (from its log)."""
        log = self.tmp / f"sshd{i}.log"
        return log.read_text(errors="replace").count("Accepted publickey") if log.exists() else 0

    def hostfile(self, slots):
        """Write a Horovod hostfile (``<ip> slots=<n>`` per host) and return its path."""
        path = self.tmp / "hostfile"
        path.write_text("".join(f"{ip} slots={slots}\n" for ip in self.ips))
        return str(path)


def _sshd_config(tmp, i, ip):
    return (f"ListenAddress {ip}\nPort 22\nHostKey {tmp}/host_ed25519\nPidFile {tmp}/sshd{i}.pid\n"
            f"AuthorizedKeysFile {tmp}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nPrintMotd no\nPrintLastLog no\nAcceptEnv none\n")


def _wait_port(ip, port, proc, log, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd on {ip} exited with code {proc.returncode}: {Path(log).read_text()}")
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"sshd on {ip}:{port} did not accept connections within {timeout:.0f} s")


def _kill_namespace_processes(ns):
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    return pids


@contextlib.contextmanager
def ssh_cluster(hosts=2, rate="1gbit"):
    """``hosts`` ssh hosts in network namespaces on a bridge, each link shaped to ``rate`` both ways (root only)."""
    remove_stale()                                   # namespaces of earlier runs whose process died
    net = Network(hosts, Rate(rate))
    ns, links = list_names()
    if any(name.startswith(net.prefix) for name in ns + links):
        raise RuntimeError(f"ssh_cluster: this process already has a network ({net.prefix}*); one at a time")
    tmp = Path(tempfile.mkdtemp(prefix="hvd_sparse_ssh_"))
    sshds = []
    made_privsep = False
    try:
        net.setup()
        for ns, link in zip(net.namespaces, net.ns_links):
            _run(["ip", "-n", ns, "link", "set", link, "down"])
            _run(["ip", "-n", ns, "link", "set", link, "name", net.bridge])
            _run(["ip", "-n", ns, "link", "set", net.bridge, "up"])
        for name in ("id_ed25519", "host_ed25519"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvd_sparse-test", "-f", str(tmp / name)])
        shutil.copy(tmp / "id_ed25519.pub", tmp / "authorized_keys")
        (tmp / "bin").mkdir()
        (tmp / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                        "  LogLevel ERROR\n  BatchMode yes\n  IdentitiesOnly yes\n")
        wrapper = tmp / "bin" / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {tmp}/ssh_config \"$@\"\n")
        wrapper.chmod(0o755)
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            made_privsep = True
        for i, (ns, ip) in enumerate(zip(net.namespaces, net.ips)):
            cfg, log = tmp / f"sshd{i}.conf", tmp / f"sshd{i}.log"
            cfg.write_text(_sshd_config(tmp, i, ip))
            with open(log, "w") as f:
                sshds.append(subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(cfg)],
                                              stdout=f, stderr=subprocess.STDOUT))
            _wait_port(ip, 22, sshds[-1], log)
        yield Cluster(net, tmp)
    finally:
        for ns in net.namespaces:
            _kill_namespace_processes(ns)
        for p in sshds:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        left = net.teardown()
        shutil.rmtree(tmp, ignore_errors=True)
        if made_privsep:
            with contextlib.suppress(OSError):
                PRIVSEP_DIR.rmdir()
        if left:
            print(f"ssh_cluster: could not remove {', '.join(left)}", file=sys.stderr)
