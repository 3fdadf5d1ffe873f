"""Network benchmark: seconds per training step of P real Horovod workers on a bandwidth-limited network.

    sudo python -m hvd_sparse.bench network --workers 4 --bandwidth 1gbit --numel 25000000 --density 0.01 \
        --algorithms dense,topka,oktopk --json net.json --plot net.png

The network (built by the command, torn down by it, root needed)::

    root namespace:   bridge <prefix>b  10.X.Y.1/24  (+ the Horovod rendezvous server, bound to that address)
                        |                |                       |
                      veth <prefix>h0   veth <prefix>h1   ...    tbf rate RATE  (egress = the worker's download)
                        |                |
    namespace <prefix>n0: <prefix>p0 10.X.Y.10   n1: p1 .11 ...  tbf rate RATE  (egress = the worker's upload)

Every worker runs in its own network namespace and owns a full-duplex "NIC" of RATE in each direction (a
``tc qdisc tbf`` on both ends of its veth pair) plugged into a non-blocking switch (the bridge): all of its
traffic, including what Horovod/Gloo sends to the other workers, crosses the shaped links. ``<prefix>`` is
``hvds<pid>`` of this process; leftovers of an earlier run that died (a prefix whose pid is gone) are
removed first, and the command tears everything down on exit, error, Ctrl-C or SIGTERM. Before the run, a
link check times one TCP stream between two namespaces (``link_check_bytes_per_s``, payload bytes/s; at
1gbit expect about 118-119e6, i.e. 125e6 minus Ethernet/IP/TCP headers).

The job: Horovod over Gloo, launched the way ``horovodrun --gloo`` does it (``horovod/runner/gloo_run.py``),
but with each rank started by ``ip netns exec <ns>``: a rendezvous server in this process, one "host" per
namespace (``local_size`` 1, ``cross_size`` P), ``HOROVOD_GLOO_IFACE`` = the namespace's veth. Rank r runs
:mod:`hvd_sparse.bench._network_worker`, which measures every algorithm in turn, with one torch thread.

One step, backward-free: the model's ``.grad`` are set from :class:`~hvd_sparse.bench.data.SyntheticGradients`
(rank- and step-dependent, fixed seed: every algorithm sees the same gradients), a barrier aligns the ranks
(an ``hvd.allreduce`` of one value), then ``optimizer.step()`` of
``hvd_sparse.torch.DistributedOptimizer(SGD, compression=...)`` is timed (exchange, write-back and the SGD
update). "dense" is Horovod's own optimizer with ``Compression.none`` (fused ring allreduce: the baseline
users have); ``dense_poll`` is the same optimizer with Horovod's ``synchronize`` (which spins: a ``yield`` loop)
replaced by the polling wait hvd_sparse's communicator uses (:func:`hvd_sparse.torch.comm.wait`), so that the
gain of waiting without spinning can be told apart from the gain of sparsification; every other name is a preset
of :mod:`hvd_sparse.bench.presets`. The model is either
``--numel`` float32 values in the 16 layers of the synthetic gradient's layout, or ``--model NAME``: the
parameter names and shapes of a real network (:data:`MODELS`). The gradient data itself is built once by
this process (the noise pool and the shared component of every step, in ``/dev/shm``) and mapped read-only
by the workers, so that 8 workers of 25M parameters fit in memory and do not each spend seconds per step
drawing random numbers.

Reported per algorithm (steps after ``--warmup`` warm-up steps; each step's time is the max over ranks):
    step_seconds_median   median over steps -- Ok-Topk's exact re-evaluation steps (every 32 steps) are
                          part of the run, as in training; ``--steps 32 --warmup 1`` includes one
    step_seconds_mean     mean over steps
    recv_bytes_mean       bytes received per rank per step, mean over steps and ranks: for sparse presets the
                          communicator's meter (``optimizer.sparse_stats()``); for dense the ring allreduce's
                          2n(P-1)/P float32 words (Horovod has no traffic counter)
    wire_seconds          recv_bytes_mean / (RATE / 8): the time the link needs for it, a lower bound
    speedup_vs_dense      dense's median / this median
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

WORKER = "hvd_sparse.bench._network_worker"
#: Horovod's optimizer (as "dense"), with its ``synchronize`` waiting as hvd_sparse's communicator does (polls and
#: sleeps instead of spinning): what dense gains from the same wait, measured next to it
DENSE_POLL = "dense_poll"
#: the command of one rank, before its arguments (None: ``[sys.executable, "-m", WORKER]``; tests replace it)
WORKER_CMD = None
#: prefix of rank 0's progress lines (the parent forwards them to stderr)
PROGRESS = "hvd_sparse.network:"
#: device and namespace names: ``hvds<pid>`` + ``b`` (bridge), ``h<i>`` (root end of worker i's veth),
#: ``p<i>`` (its namespace end), ``n<i>`` (its namespace); at most 15 characters (IFNAMSIZ)
NAME = re.compile(r"^hvds(\d+)(b|[hpn]\d+)$")
DATA_DIR_PREFIX = "hvd_sparse_network_"
MAX_WORKERS = 64
#: private memory of one worker: a base (torch, Horovod) plus bytes per parameter (parameters, the step's
#: gradient, the optimizer's flat buffers, residual and temporaries); measured peaks at n = 25M: 0.8 GiB (dense),
#: 0.95-1.3 GiB (oktopk), 1.2 GiB (topka) over 3 steps at P = 2 and 4, up to 1.95 GiB over 33 steps at P = 8
WORKER_BASE_BYTES = 300 * 2**20
WORKER_BYTES_PER_PARAM = 68
#: per-namespace configuration files that ``ip netns exec`` bind-mounts over /etc
ETC_NETNS = Path("/etc/netns")


class NetworkError(RuntimeError):
    """The network could not be built (missing privileges or kernel support); exit code 2."""


class WorkerFailed(RuntimeError):
    """A worker exited with an error or the run timed out (the message ends with the workers' output)."""


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


# -- real models: parameter names and shapes ----------------------------------------------------------------

def _resnet(block, layers, classes=1000):
    """torchvision.models.resnet (v1.5): names and shapes of ``named_parameters()`` (BN buffers excluded)."""
    out = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    expansion = 4 if block == "bottleneck" else 1
    inplanes = 64
    for li, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers), 1):
        for b in range(blocks):
            pre = f"layer{li}.{b}."
            if block == "basic":
                convs = [(inplanes, planes, 3), (planes, planes, 3)]
            else:
                convs = [(inplanes, planes, 1), (planes, planes, 3), (planes, planes * 4, 1)]
            for ci, (cin, cout, ks) in enumerate(convs, 1):
                out += [(f"{pre}conv{ci}.weight", (cout, cin, ks, ks)), (f"{pre}bn{ci}.weight", (cout,)),
                        (f"{pre}bn{ci}.bias", (cout,))]
            if b == 0 and (li > 1 or inplanes != planes * expansion):
                out += [(f"{pre}downsample.0.weight", (planes * expansion, inplanes, 1, 1)),
                        (f"{pre}downsample.1.weight", (planes * expansion,)),
                        (f"{pre}downsample.1.bias", (planes * expansion,))]
            inplanes = planes * expansion
    return out + [("fc.weight", (classes, 512 * expansion)), ("fc.bias", (classes,))]


def _convnet(features, classifier):
    """torchvision-style ``features.<i>`` convolutions and ``classifier.<i>`` linear layers."""
    out = []
    for prefix, layers in (("features", features), ("classifier", classifier)):
        for i, shape in layers:
            out += [(f"{prefix}.{i}.weight", shape), (f"{prefix}.{i}.bias", (shape[0],))]
    return out


def _vgg16():
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    feats, i, cin = [], 0, 3
    for c in cfg:                       # Sequential indices count the ReLU and MaxPool modules too
        if c == "M":
            i += 1
        else:
            feats.append((i, (c, cin, 3, 3)))
            i, cin = i + 2, c
    return _convnet(feats, [(0, (4096, 512 * 7 * 7)), (3, (4096, 4096)), (6, (1000, 4096))])


def _alexnet():
    return _convnet([(0, (64, 3, 11, 11)), (3, (192, 64, 5, 5)), (6, (384, 192, 3, 3)), (8, (256, 384, 3, 3)),
                     (10, (256, 256, 3, 3))],
                    [(1, (4096, 256 * 6 * 6)), (4, (4096, 4096)), (6, (1000, 4096))])


def _bert_base(vocab=30522, hidden=768, layers=12, inter=3072, positions=512):
    """Hugging Face ``BertModel`` (bert-base-uncased), pooler included."""
    h = hidden
    out = [("embeddings.word_embeddings.weight", (vocab, h)), ("embeddings.position_embeddings.weight", (positions, h)),
           ("embeddings.token_type_embeddings.weight", (2, h)), ("embeddings.LayerNorm.weight", (h,)),
           ("embeddings.LayerNorm.bias", (h,))]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for lin in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out += [(f"{p}{lin}.weight", (h, h)), (f"{p}{lin}.bias", (h,))]
        out += [(f"{p}attention.output.LayerNorm.weight", (h,)), (f"{p}attention.output.LayerNorm.bias", (h,)),
                (f"{p}intermediate.dense.weight", (inter, h)), (f"{p}intermediate.dense.bias", (inter,)),
                (f"{p}output.dense.weight", (h, inter)), (f"{p}output.dense.bias", (h,)),
                (f"{p}output.LayerNorm.weight", (h,)), (f"{p}output.LayerNorm.bias", (h,))]
    return out + [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]


def _gpt2(vocab=50257, hidden=768, layers=12, positions=1024):
    """Hugging Face ``GPT2Model`` (gpt2, "small"; the LM head is tied to ``wte``)."""
    h = hidden
    out = [("wte.weight", (vocab, h)), ("wpe.weight", (positions, h))]
    for i in range(layers):
        p = f"h.{i}."
        out += [(f"{p}ln_1.weight", (h,)), (f"{p}ln_1.bias", (h,)),
                (f"{p}attn.c_attn.weight", (h, 3 * h)), (f"{p}attn.c_attn.bias", (3 * h,)),
                (f"{p}attn.c_proj.weight", (h, h)), (f"{p}attn.c_proj.bias", (h,)),
                (f"{p}ln_2.weight", (h,)), (f"{p}ln_2.bias", (h,)),
                (f"{p}mlp.c_fc.weight", (h, 4 * h)), (f"{p}mlp.c_fc.bias", (4 * h,)),
                (f"{p}mlp.c_proj.weight", (4 * h, h)), (f"{p}mlp.c_proj.bias", (h,))]
    return out + [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]


#: ``--model`` name -> (builder of [(parameter name, shape)], total, source). The totals are the published
#: parameter counts (torchvision's model docs, "num_params"; Hugging Face model cards), and the tests check
#: that the shapes add up to them.
MODELS = {
    "resnet18": (lambda: _resnet("basic", (2, 2, 2, 2)), 11_689_512, "torchvision.models.resnet18"),
    "resnet50": (lambda: _resnet("bottleneck", (3, 4, 6, 3)), 25_557_032, "torchvision.models.resnet50"),
    "resnet101": (lambda: _resnet("bottleneck", (3, 4, 23, 3)), 44_549_160, "torchvision.models.resnet101"),
    "alexnet": (_alexnet, 61_100_840, "torchvision.models.alexnet"),
    "vgg16": (_vgg16, 138_357_544, "torchvision.models.vgg16"),
    "bert-base": (_bert_base, 109_482_240, "transformers BertModel, bert-base-uncased"),
    "gpt2": (_gpt2, 124_439_808, "transformers GPT2Model, gpt2 (small)"),
}


def model_layout(name):
    """``[(parameter name, shape)]`` of ``--model name``, sorted by name (the optimizer's exchange order)."""
    if name not in MODELS:
        raise ValueError(f"hvd_sparse.bench network: unknown model {name!r}; choose from {', '.join(MODELS)}")
    return sorted(MODELS[name][0](), key=lambda t: t[0])


def synthetic_layout(n, layers=16):
    """``--numel n``: the synthetic gradient's own layer sizes as 1-D parameters ``synthetic.00``, ...
    (in name order == layout order, so each parameter holds one of the gradient's layers)."""
    from .data import layer_sizes

    sizes = layer_sizes(n, layers)
    return [(f"synthetic.{i:02d}", (s,)) for i, s in enumerate(sizes)]


def model_choice(text):
    if text not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; choose from {', '.join(MODELS)}")
    return text


# -- gradient data shared through /dev/shm -----------------------------------------------------------------

def _shm_root():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def data_bytes(n, steps):
    """Bytes of the shared gradient data: noise pool (8 n), scale (n) and one shared component per step."""
    return (8 + 1 + steps) * n * 4


def write_gradient_data(directory, n, workers, steps, seed, progress=None):
    """Write what :class:`SharedGradients` maps: the pieces of ``SyntheticGradients(n, workers, seed)`` that are
    identical on every rank (noise pool, per-layer scale, shared component c[t] for t < steps)."""
    import numpy as np
    from numpy.lib.format import open_memmap

    from .data import SyntheticGradients

    src = SyntheticGradients(n, workers, seed=seed)
    d = Path(directory)
    meta = {"n": src.n, "workers": src.workers, "seed": src.seed, "rho": src.rho, "noise": src.noise,
            "layout": list(src.layout), "steps": steps, "pool": len(src._noise_pool)}
    pool = open_memmap(d / "pool.npy", mode="w+", dtype=np.float32, shape=(len(src._noise_pool), n))
    for i, v in enumerate(src._noise_pool):
        pool[i] = v
    del pool
    src._noise_pool = None
    np.save(d / "scale.npy", src.scale)
    common = open_memmap(d / "common.npy", mode="w+", dtype=np.float32, shape=(steps, n))
    for t in range(steps):
        common[t] = src.common(t)
        if progress:
            progress(t + 1, steps)
    del common
    (d / "meta.json").write_text(json.dumps(meta))


def _cleanup_stale_data_dirs(root):
    if root is None:
        return
    for p in Path(root).glob(f"{DATA_DIR_PREFIX}*"):
        m = re.match(rf"{DATA_DIR_PREFIX}(\d+)_", p.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


# -- the network ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _signals_deferred():
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


def _pid_alive(pid):
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
        return (include_own and pid == os.getpid()) or not _pid_alive(pid)

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
            with _signals_deferred():
                self.teardown()
            raise

    def __exit__(self, *exc):
        with _signals_deferred():
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


# -- the job ----------------------------------------------------------------------------------------------------

def _start_rendezvous(host_ip, workers):
    """Horovod's gloo rendezvous server (``RendezvousServer``), bound to ``host_ip``, initialised with one host
    per worker. Returns (server, port)."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    plan = get_host_assignments([HostInfo(f"worker{i}", 1) for i in range(workers)], workers)
    httpd = RendezvousHTTPServer((host_ip, 0), RendezvousHandler, 0)
    httpd.init(plan)
    thread = threading.Thread(target=httpd.serve_forever, name="hvd_sparse-rendezvous", daemon=True)
    thread.start()
    return httpd, httpd.server_address[1], plan


def _tail(path, lines=40):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def launch(net, worker_args, logdir, timeout, verbose=True, worker_cmd=None, gloo_timeout=120):
    """Start one Horovod rank per namespace, forward rank 0's progress, wait for all of them.

    Raises :class:`WorkerFailed` (naming the rank, with the tails of the failed ranks' output) when a rank
    exits with an error, or when the whole run exceeds ``timeout`` seconds; the other ranks are then stopped.
    """
    httpd, port, plan = _start_rendezvous(net.bridge_ip, net.workers)
    root = str(Path(__file__).resolve().parents[2])        # so that the ranks import this hvd_sparse
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                HOROVOD_GLOO_RENDEZVOUS_ADDR=net.bridge_ip, HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                HOROVOD_GLOO_TIMEOUT_SECONDS=str(gloo_timeout))
    cmd = worker_cmd or WORKER_CMD or [sys.executable, "-m", WORKER]
    procs, logs = [], []
    try:
        for slot, ns, link in zip(plan, net.namespaces, net.ns_links):
            env = dict(base, HOROVOD_GLOO_IFACE=link, NCCL_SOCKET_IFNAME=link, HOROVOD_HOSTNAME=slot.hostname,
                       HOROVOD_RANK=str(slot.rank), HOROVOD_SIZE=str(slot.size),
                       HOROVOD_LOCAL_RANK=str(slot.local_rank), HOROVOD_LOCAL_SIZE=str(slot.local_size),
                       HOROVOD_CROSS_RANK=str(slot.cross_rank), HOROVOD_CROSS_SIZE=str(slot.cross_size))
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
            offset = _forward_progress(logs[0], offset, verbose)
            for r, c in enumerate(codes):
                if c not in (None, 0) and r not in failed:
                    failed.append(r)
            if failed:
                time.sleep(1.0)                            # let the other ranks report their side
                for r, p in enumerate(procs):
                    if p.poll() not in (None, 0) and r not in failed:
                        failed.append(r)
                parts = [f"--- rank {r} (exit code {procs[r].returncode}) in {net.namespaces[r]} ---\n"
                         f"{_tail(logs[r])}" for r in failed]
                raise WorkerFailed(f"rank {failed[0]} exited with code {procs[failed[0]].returncode}; all "
                                   f"ranks stopped. Output of the failed rank(s):\n" + "\n".join(parts))
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise WorkerFailed(f"timeout: the run exceeded {timeout:.0f} s (--timeout); ranks "
                                   f"{running} still running were stopped. Rank 0's output:\n{_tail(logs[0])}")
            time.sleep(0.2)
    finally:
        with _signals_deferred():
            _stop(procs)
            httpd.shutdown()
            httpd.server_close()


def _forward_progress(log, offset, verbose):
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
            if line.startswith(PROGRESS):
                print("  " + line[len(PROGRESS):].strip(), file=sys.stderr, flush=True)
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


# -- results ----------------------------------------------------------------------------------------------------

def summarize(raw, workers, numel, rate, warmup):
    """Rows of the report from the workers' raw per-rank, per-step records (see the module docstring)."""
    rows = []
    for run in raw:
        secs = [max(col) for col in zip(*run["seconds"])][warmup:]          # max over ranks, each step
        if run["algorithm"] in ("dense", DENSE_POLL):
            recv, source = 2 * numel * (workers - 1) / workers * 4, "ring allreduce formula 2n(P-1)/P x 4 B"
            density = 1.0
        else:
            recv = statistics.fmean(v for rank in run["recv_bytes"] for v in rank[warmup:])
            source = "measured (optimizer.sparse_stats)"
            sel = [statistics.fmean(col) for col in zip(*run["selected"])][warmup:]
            density = statistics.fmean(sel) / numel * (workers if run.get("partitioned") else 1)
        special = [t for t, s in enumerate(run.get("special", [])[warmup:]) if s]
        rows.append({
            "algorithm": run["algorithm"],
            "step_seconds_median": statistics.median(secs),
            "step_seconds_mean": statistics.fmean(secs),
            "step_seconds_min": min(secs),
            "step_seconds_max": max(secs),
            "recv_bytes_mean": recv,
            "recv_bytes_source": source,
            "wire_seconds": recv / (rate / 8),
            "density_mean": density,
            "step_seconds": secs,
            "special_steps": special,
        })
    dense = next((r for r in rows if r["algorithm"] == "dense"), None)
    for r in rows:
        r["speedup_vs_dense"] = dense["step_seconds_median"] / r["step_seconds_median"] if dense else None
    return rows


def run(algorithms, workers, rate, numel=None, model=None, density=0.01, steps=32, warmup=1, seed=0, lr=0.01,
        timeout=3600.0, link_check_seconds=0.5, verbose=True, worker_cmd=None, profile=False):
    """Build the network, run the job, tear everything down; return the report (see the module docstring)."""
    import numpy as np

    def say(msg, end="\n"):
        if verbose:
            print(msg, end=end, file=sys.stderr, flush=True)

    if model is not None:
        layout = model_layout(model)
        numel = sum(int(np.prod(s)) for _, s in layout)
    T = warmup + steps
    shm = _shm_root()
    _cleanup_stale_data_dirs(shm)
    _cleanup_stale_data_dirs(tempfile.gettempdir())
    remove_stale(say, include_own=True)
    load_before = list(os.getloadavg())
    tmp = tempfile.mkdtemp(prefix=f"{DATA_DIR_PREFIX}{os.getpid()}_", dir=shm)
    try:
        t0 = time.perf_counter()

        tty = sys.stderr.isatty()

        def progress(t, total):
            if tty or t == total:
                say(f"\r  gradient data: step {t}/{total} ({time.perf_counter() - t0:.0f} s)",
                    end="" if t < total else "\n")

        say(f"  gradient data: {data_bytes(numel, T) / 2**30:.2f} GiB in {tmp}")
        write_gradient_data(tmp, numel, workers, T, seed, progress)
        with Network(workers, rate) as net:
            say(f"  network: {workers} namespaces {net.namespaces[0]}..{net.namespaces[-1]} on bridge "
                f"{net.bridge} ({net.subnet}.0/24), tbf {rate.text if hasattr(rate, 'text') else rate} "
                "each way per worker")
            link = link_check(net, link_check_seconds) if link_check_seconds else None
            if link is not None:
                say(f"  link check: {link / 1e6:.1f} MB/s payload, one TCP stream "
                    f"({net.namespaces[0]} -> {net.namespaces[1]}; line rate {rate / 8e6:.1f} MB/s)")
            out = Path(tmp) / "result.json"
            args = ["--algorithms", ",".join(algorithms), "--density", density, "--steps", steps,
                    "--warmup", warmup, "--seed", seed, "--lr", lr, "--data", tmp, "--out", out]
            args += ["--model", model] if model else ["--numel", numel]
            if profile:
                args += ["--profile", Path(tmp) / "profile"]
            launch(net, args, tmp, timeout, verbose=verbose, worker_cmd=worker_cmd)
            if not out.exists():
                raise WorkerFailed(f"the workers exited normally but rank 0 wrote no result; rank 0's output:\n"
                                   f"{_tail(Path(tmp) / 'rank0.log')}")
            raw = json.loads(out.read_text())
            profiles = {}
            if profile:
                for p in sorted(Path(tmp).glob("profile*.txt")):
                    profiles[p.stem] = p.read_text()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"workers": workers, "bandwidth": str(rate), "bandwidth_bits_per_s": int(rate), "numel": numel,
              "model": model, "density": density, "steps": steps, "warmup": warmup, "seed": seed, "lr": lr,
              "torch_threads": raw["torch_threads"], "link_check_bytes_per_s": link,
              "cpus": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": list(os.getloadavg()),
              "worker_private_peak_bytes": max(raw.get("private_peak_bytes") or [0]),
              "shared_data_bytes": data_bytes(numel, T),
              "results": summarize(raw["runs"], workers, numel, rate, warmup)}
    if profiles:
        report["profiles"] = profiles
    return report


def _mb(b):
    return f"{b / 1e6:,.2f} MB" if b >= 1e5 else f"{b / 1e3:,.1f} kB"


def markdown(report):
    what = (f"{report['model']} ({report['numel']:,} parameters)" if report.get("model")
            else f"n = {report['numel']:,} parameters")
    link = report.get("link_check_bytes_per_s")
    lines = [f"P = {report['workers']} Horovod workers (Gloo), one network namespace each, {report['bandwidth']} "
             f"full duplex per worker (tc tbf both ways"
             + (f"; link check {link / 1e6:.1f} MB/s" if link else "") + f"); {what}, density "
             f"{report['density']}; median and mean of {report['steps']} steps after {report['warmup']} warm-up, "
             f"each step the slowest rank; {report['torch_threads']} torch thread per worker.", "",
             "| algorithm | step s (median) | step s (mean) | speedup vs dense | recv per rank per step "
             "| wire s at line rate | density |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        sp = "" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        lines.append(f"| {r['algorithm']} | {r['step_seconds_median']:.3f} | {r['step_seconds_mean']:.3f} | {sp} | "
                     f"{_mb(r['recv_bytes_mean'])} | {r['wire_seconds']:.3f} | {r['density_mean']:.4f} |")
    if any(r["algorithm"] == "dense" for r in report["results"]):
        lines.append("")
        lines.append("dense = Horovod's own optimizer (Compression.none, ring allreduce); its bytes are the ring "
                     "formula 2n(P-1)/P x 4 B, the sparse presets' are measured.")
    if any(r["algorithm"] == DENSE_POLL for r in report["results"]):
        lines.append(f"{DENSE_POLL} = dense with Horovod's spinning synchronize() replaced by hvd_sparse's polling "
                     "wait (hvd_sparse.torch.comm.wait), as the sparse presets wait.")
    return "\n".join(lines)


def plot(report, path):
    """PNG: one bar per algorithm, median seconds per step (the mean as a black tick), wire time hatched."""
    from . import cli, presets

    plt = cli.pyplot()
    res = report["results"]
    names = [r["algorithm"] for r in res]
    med = [r["step_seconds_median"] for r in res]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(res) + 1.8))
    y = list(range(len(res)))[::-1]
    ax.barh(y, med, color=[cli.color_of(a, presets.names()) for a in names], label="median step")
    ax.barh(y, [r["wire_seconds"] for r in res], height=0.3, color="none", edgecolor="black", hatch="//",
            label="bytes received / line rate")
    ax.plot([r["step_seconds_mean"] for r in res], y, "|", color="black", markersize=16, label="mean step")
    for yi, r in zip(y, res):
        sp = "" if r["speedup_vs_dense"] is None or r["algorithm"] == "dense" else \
            f"  ({r['speedup_vs_dense']:.2f}x dense)"
        ax.text(max(r["step_seconds_median"], r["step_seconds_mean"]), yi,
                f"  {r['step_seconds_median']:.3g} s{sp}", va="center", fontsize=8)
    ax.set_yticks(y, names)
    ax.set_xlim(0, max(max(med), max(r["step_seconds_mean"] for r in res)) * 1.45)
    ax.set_xlabel("seconds per step (slowest rank)")
    what = report["model"] or f"n = {report['numel']:,}"
    ax.set_title(f"P = {report['workers']}, {report['bandwidth']} per worker, {what}, density {report['density']}",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    cli.save_png(fig, path)


# -- command line ---------------------------------------------------------------------------------------------

def add_arguments(p):
    from . import cli

    p.add_argument("--workers", type=workers, default=4,
                   help=f"Horovod workers P, one network namespace each, 2..{MAX_WORKERS} (default: 4)")
    p.add_argument("--bandwidth", type=bandwidth, default=Rate("1gbit"),
                   help="each worker's link rate, each direction, as tc writes it: 1gbit, 500mbit, 100mbit "
                        "(default: 1gbit)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--numel", type=cli.positive_int, default=None,
                      help="gradient size n: n float32 parameters in 16 layers (default: 25,000,000)")
    size.add_argument("--model", type=model_choice, default=None,
                      help=f"the parameter names and shapes of a real model instead: {', '.join(MODELS)}")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    p.add_argument("--steps", type=cli.positive_int, default=32,
                   help="measured steps per algorithm (default: 32; with --warmup 1 this includes one of "
                        "Ok-Topk's exact threshold re-evaluations, as in training)")
    p.add_argument("--warmup", type=cli.positive_int, default=1,
                   help="steps run before the measured ones, not reported (default: 1, at least 1)")
    p.add_argument("--algorithms", type=lambda text: cli.algorithms(text, extra=(DENSE_POLL,)), default=None,
                   help="comma-separated subset; dense = Horovod's own allreduce; dense_poll = the same with "
                        "Horovod's spinning wait replaced by hvd_sparse's polling one (default: all presets)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradients (default: 0)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default: 0.01)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds before the whole run is stopped (default: 3600)")
    p.add_argument("--no-link-check", action="store_true", help="skip the TCP throughput check of one link")
    p.add_argument("--profile", action="store_true",
                   help="cProfile every rank's measured steps; the top functions go into the JSON")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save a PNG bar chart of the seconds per step")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(args):
    from . import cli, presets

    prog = "python -m hvd_sparse.bench network"
    missing = missing_requirements()
    if missing:
        print(f"{prog}: error: this benchmark builds network namespaces and needs " + "; ".join(missing) + ".",
              file=sys.stderr)
        return 2
    algorithms = args.algorithms or presets.names()
    numel = args.numel if args.numel is not None or args.model else 25_000_000
    n_total = MODELS[args.model][1] if args.model else numel
    shared = data_bytes(n_total, args.warmup + args.steps)
    private = WORKER_BASE_BYTES + WORKER_BYTES_PER_PARAM * n_total
    avail = _mem_available()
    if avail is not None and shared + args.workers * private > avail:
        print(f"{prog}: error: not enough memory: the shared gradient data needs {shared / 2**30:.1f} GiB "
              f"((9 + warmup + steps) x n x 4 bytes) and each of the {args.workers} workers about "
              f"{private / 2**30:.1f} GiB (0.3 GiB + {WORKER_BYTES_PER_PARAM} bytes per parameter), but "
              f"{avail / 2**30:.1f} GiB is available; lower --workers, --numel or --steps", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"network: {', '.join(algorithms)} on {args.workers} Horovod workers, {args.bandwidth} per worker",
              file=sys.stderr, flush=True)
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        report = run(algorithms, args.workers, args.bandwidth, numel=None if args.model else numel,
                     model=args.model, density=args.density, steps=args.steps, warmup=args.warmup, seed=args.seed,
                     lr=args.lr, timeout=args.timeout, link_check_seconds=0 if args.no_link_check else 0.5,
                     verbose=not args.quiet, profile=args.profile)
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


def _mem_available():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
