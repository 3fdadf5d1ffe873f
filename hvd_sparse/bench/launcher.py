"""Launch one Horovod rank per network namespace of a :class:`~hvd_sparse.bench.netns.Network`, the way
``horovodrun --gloo`` does it (``horovod/runner/gloo_run.py``), but with each rank started by
``ip netns exec <ns>``: a rendezvous server in this process bound to the bridge's address, one "host" per
namespace (``local_size`` 1, ``cross_size`` P), ``HOROVOD_GLOO_IFACE`` = the namespace's veth.

The same environment carries what ``torch.distributed`` needs for a gloo process group over the same links
(``MASTER_ADDR`` = rank 0's address, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``), so a
worker can run Horovod and PyTorch DDP side by side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .netns import signals_deferred

#: the port of the torch.distributed rendezvous (rank 0's TCPStore) inside the namespaces
TORCH_MASTER_PORT = 29517


class WorkerFailed(RuntimeError):
    """A worker exited with an error or the run timed out (the message ends with the workers' output)."""


def _start_rendezvous(host_ip, hosts, ranks_per_host=1):
    """Horovod's gloo rendezvous server (``RendezvousServer``), bound to ``host_ip``, initialised with ``hosts``
    hosts of ``ranks_per_host`` ranks (host i: ``worker<i>``, its ranks' cross rank i). Returns (server, port,
    the slots)."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    plan = get_host_assignments([HostInfo(f"worker{i}", ranks_per_host) for i in range(hosts)],
                                hosts * ranks_per_host)
    httpd = RendezvousHTTPServer((host_ip, 0), RendezvousHandler, 0)
    httpd.init(plan)
    thread = threading.Thread(target=httpd.serve_forever, name="hvd_sparse-rendezvous", daemon=True)
    thread.start()
    return httpd, httpd.server_address[1], plan


def tail(path, lines=40):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def launch(net, cmd, worker_args, logdir, timeout, progress, verbose=True, gloo_timeout=120, ranks_per_host=1):
    """Start ``cmd + worker_args`` as ``ranks_per_host`` Horovod ranks per namespace (each namespace a host: its
    ranks talk over its loopback, the hosts over their shaped links; process sets allowed, for two levels), forward
    rank 0's lines that start with ``progress`` to stderr (``verbose``), wait for all of them. Rank r's output goes
    to ``<logdir>/rank<r>.log``.

    Raises :class:`WorkerFailed` (naming the rank, with the tails of the failed ranks' output) when a rank
    exits with an error, or when the whole run exceeds ``timeout`` seconds; the other ranks are then stopped.
    """
    httpd, port, plan = _start_rendezvous(net.bridge_ip, net.workers, ranks_per_host)
    root = str(Path(__file__).resolve().parents[2])        # so that the ranks import this hvd_sparse
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    # every namespace is a host of one rank to Horovod, but all share this machine's cores: hvd_sparse's "auto"
    # wait would spin (a core per rank on each "host"); poll, as on any machine with more ranks than cores
    base.setdefault("HVD_SPARSE_WAIT", "poll")
    base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                HOROVOD_GLOO_RENDEZVOUS_ADDR=net.bridge_ip, HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                HOROVOD_GLOO_TIMEOUT_SECONDS=str(gloo_timeout),
                MASTER_ADDR=net.ips[0], MASTER_PORT=str(TORCH_MASTER_PORT), WORLD_SIZE=str(len(plan)))
    if ranks_per_host > 1:
        base["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"          # two levels register the hosts' process sets
    procs, logs = [], []
    try:
        for slot in plan:
            ns, link = net.namespaces[slot.cross_rank], net.ns_links[slot.cross_rank]
            env = dict(base, HOROVOD_GLOO_IFACE=link, NCCL_SOCKET_IFNAME=link, HOROVOD_HOSTNAME=slot.hostname,
                       HOROVOD_RANK=str(slot.rank), HOROVOD_SIZE=str(slot.size),
                       HOROVOD_LOCAL_RANK=str(slot.local_rank), HOROVOD_LOCAL_SIZE=str(slot.local_size),
                       HOROVOD_CROSS_RANK=str(slot.cross_rank), HOROVOD_CROSS_SIZE=str(slot.cross_size),
                       RANK=str(slot.rank), GLOO_SOCKET_IFNAME=link)
            log = Path(logdir) / f"rank{slot.rank}.log"
            logs.append(log)
            with open(log, "w") as f:
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd, *map(str, worker_args)],
                                              stdout=f, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        offset = 0
        failed = []                                        # ranks in the order their failure was seen
        while True:
            codes = [p.poll() for p in procs]
            offset = _forward_progress(logs[0], offset, progress, verbose)
            for r, c in enumerate(codes):
                if c not in (None, 0) and r not in failed:
                    failed.append(r)
            if failed:
                time.sleep(1.0)                            # let the other ranks report their side
                for r, p in enumerate(procs):
                    if p.poll() not in (None, 0) and r not in failed:
                        failed.append(r)
                parts = [f"--- rank {r} (exit code {procs[r].returncode}) in {net.namespaces[plan[r].cross_rank]} ---\n"
                         f"{tail(logs[r])}" for r in failed]
                raise WorkerFailed(f"rank {failed[0]} exited with code {procs[failed[0]].returncode}; all "
                                   f"ranks stopped. Output of the failed rank(s):\n" + "\n".join(parts))
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise WorkerFailed(f"timeout: the run exceeded {timeout:.0f} s (--timeout); ranks "
                                   f"{running} still running were stopped. Rank 0's output:\n{tail(logs[0])}")
            time.sleep(0.2)
    finally:
        with signals_deferred():
            _stop(procs)
            httpd.shutdown()
            httpd.server_close()


def _forward_progress(log, offset, progress, verbose):
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    end = chunk.rfind(b"\n")
    if end < 0:
        return offset
    if verbose:
        for line in chunk[:end].decode(errors="replace").splitlines():
            if line.startswith(progress):
                print("  " + line[len(progress):].strip(), file=sys.stderr, flush=True)
    return offset + end + 1


def _stop(procs, grace=5.0):
    """SIGTERM every running worker (its whole session), then SIGKILL after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def missing_message(prog):
    """The usage error of a namespace benchmark on a machine that cannot build namespaces, or None."""
    from .netns import missing_requirements

    missing = missing_requirements()
    if missing:
        return f"{prog}: error: this benchmark builds network namespaces and needs " + "; ".join(missing) + "."
    return None


def add_run_arguments(p, timeout, plot_help):
    """The flags every namespace benchmark has, read by :func:`run_cli` and ``run``: ``--timeout`` (default
    ``timeout`` seconds), ``--no-link-check``, ``--json``, ``--plot`` (``plot_help``) and ``--quiet``."""
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"seconds before the whole run is stopped (default: {timeout:g})")
    p.add_argument("--no-link-check", action="store_true", help="skip the TCP throughput check of one link")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help=plot_help)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run_cli(prog, args, run, plot, markdown, check=None, banner=None):
    """A namespace benchmark's ``main`` after parsing: usage errors first (exit code 2: a machine that cannot build
    namespaces, or ``check()``'s message when it returns one), ``banner`` on stderr unless ``--quiet``, then
    ``run()`` (SIGTERM and SIGHUP stop it as an interrupt, which stops the workers and removes the network), its
    errors as exit codes (2: the network could not be built, 1: a worker failed, 130: interrupted), then the report
    as ``--json``, ``--plot`` and Markdown on stdout."""
    from . import cli
    from .netns import NetworkError

    missing = missing_message(prog)
    problem = check() if missing is None and check is not None else None
    if missing or problem:
        print(missing or f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    if banner and not args.quiet:
        print(banner, file=sys.stderr, flush=True)
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        report = run()
    except NetworkError as e:
        print(f"{prog}: error: could not build the benchmark network: {e}", file=sys.stderr)
        return 2
    except WorkerFailed as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; workers stopped, network removed", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(markdown(report))
    return 0
