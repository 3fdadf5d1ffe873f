"""Keep TensorFlow's start-up noise out of what a person reads.

Every process that imports TensorFlow 2.21 (each rank, and ``horovodrun`` itself, which loads Horovod's TensorFlow
extension to see how it was built) writes lines such as::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795537719.597807   18211 port.cc:153] oneDNN custom operations are on. ...
    I0000 00:00:1795537719.598354   18211 cudart_stub.cc:31] Could not find cuda drivers on your machine, ...
    E0000 00:00:1795537752.396824   19549 cuda_platform.cc:52] failed call to cuInit: ...

before its logging is set up, so ``TF_CPP_MIN_LOG_LEVEL`` does not silence them. Two ways to drop exactly these
lines (:data:`NOISE`; every other line, errors included, passes through unchanged and in order):

* :func:`filter_stderr`, first thing in a script (before TensorFlow is imported): this process's standard error
  goes through a filter process for the rest of its life (the examples and benchmark workers call it);
* ``python -m hvd_sparse.quiet COMMAND ...``: runs COMMAND with its standard output and error filtered and exits
  with its exit code -- for the launcher's own lines, e.g. ``python -m hvd_sparse.quiet horovodrun -np 2 ...``
  (``make demo`` does this).

``HVD_SPARSE_VERBOSE=1`` turns both off: everything is printed, as without them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

#: TensorFlow/absl start-up lines, also with horovodrun's ``[<rank>]<stdout|stderr>:`` prefix
NOISE = re.compile(
    rb"^(\[\d+\]<std(out|err)>:)?("
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|[IWE]\d{4} [\d:.]+ +\d+ (port\.cc:\d+\] oneDNN custom operations are on"
    rb"|cudart_stub\.cc:\d+\] Could not find cuda drivers"
    rb"|cuda_platform\.cc:\d+\] failed call to cuInit"
    rb"|cuda_executor\.cc:\d+\] .*(cuInit|CUDA|GPU)))")
VERBOSE = "HVD_SPARSE_VERBOSE"

_filtering = False


def verbose():
    """True when ``HVD_SPARSE_VERBOSE`` asks for everything (``1``, ``true``, ``yes``)."""
    return os.environ.get(VERBOSE, "").strip().lower() in ("1", "true", "yes", "on")


def _copy(src, dst_fd):
    """Copy lines from the binary file ``src`` to ``dst_fd``, without the :data:`NOISE` lines, until EOF."""
    for line in src:
        if not NOISE.match(line):
            view = memoryview(line)
            while view:
                view = view[os.write(dst_fd, view):]


def filter_stderr():
    """From now on, this process's standard error (file descriptor 2, so also what C++ code and child processes
    write there) goes through a child process that drops the :data:`NOISE` lines. The child reads until every writer
    is gone, so nothing is lost when this process exits or dies. Does nothing with ``HVD_SPARSE_VERBOSE=1``, when
    already done, or where ``fork`` is missing."""
    global _filtering
    if _filtering or verbose() or not hasattr(os, "fork"):
        return
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                                        # the filter: no Python-level cleanup, just copy and leave
        try:
            os.close(write_fd)
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C stops the program; the filter drains its output
            with os.fdopen(read_fd, "rb") as src:
                _copy(src, 2)
        finally:
            os._exit(0)
    os.close(read_fd)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    _filtering = True


def run(cmd):
    """Run ``cmd`` with its standard output and error filtered; returns its exit code."""
    if verbose():
        return subprocess.call(cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    threads = [threading.Thread(target=_copy, args=(stream, fd), daemon=True)
               for stream, fd in ((proc.stdout, 1), (proc.stderr, 2))]
    for t in threads:
        t.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:                           # the command got the Ctrl-C too: let it finish
        code = proc.wait()
    for t in threads:
        t.join()
    return code


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hvd_sparse.quiet COMMAND [ARG ...]\n\n" + __doc__.split("\n\n")[0],
              file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
