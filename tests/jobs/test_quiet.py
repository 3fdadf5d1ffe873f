"""hvd_sparse.quiet: TensorFlow's start-up lines are dropped, every other line passes in order (errors included),
exit codes are kept, and HVD_SPARSE_VERBOSE=1 turns the filter off."""

import os
import subprocess
import sys

NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795537719.597807   18211 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders.",
    "I0000 00:00:1795537719.598354   18211 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.",
    "[1]<stderr>:E0000 00:00:1795537752.451631   19546 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA "
    "error: Failed call to cuInit: UNKNOWN ERROR (303)",
]
KEEP = ["[0]<stdout>:epoch  1  loss 2.2850", "E0000 00:00:1795537752.4 123 gloo.cc:10] connection refused",
        "Traceback (most recent call last):", "ValueError: bad rank"]

# a child that writes noise and real lines to fd 2 from C-level writes (as TensorFlow does) and to stdout
CHILD = f"""
import os, sys
lines = {NOISE + KEEP!r}
for i, line in enumerate(lines):
    os.write(2 if i % 2 == 0 else 1, (line + "\\n").encode())
sys.exit(3)
"""


def _env(**extra):
    env = dict(os.environ, **extra)
    env.pop("HVD_SPARSE_VERBOSE", None)
    env.update(extra)
    return env


def _lines(text):
    return [line for line in text.splitlines() if line]


def test_run_drops_only_the_start_up_lines_and_keeps_the_exit_code():
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.quiet", sys.executable, "-c", CHILD],
                          capture_output=True, text=True, env=_env())
    assert proc.returncode == 3
    assert sorted(_lines(proc.stdout) + _lines(proc.stderr)) == sorted(KEEP)


def test_filter_stderr_in_the_process_itself():
    code = "from hvd_sparse.quiet import filter_stderr\nfilter_stderr()\n" + CHILD
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 3
    kept_err = [line for i, line in enumerate(NOISE + KEEP) if i % 2 == 0 and line in KEEP]
    assert _lines(proc.stderr) == kept_err                      # in order, nothing lost at exit
    assert _lines(proc.stdout) == [line for i, line in enumerate(NOISE + KEEP) if i % 2 == 1]   # stdout untouched


def test_verbose_keeps_everything():
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.quiet", sys.executable, "-c", CHILD],
                          capture_output=True, text=True, env=_env(HVD_SPARSE_VERBOSE="1"))
    assert proc.returncode == 3
    assert sorted(_lines(proc.stdout) + _lines(proc.stderr)) == sorted(NOISE + KEEP)
