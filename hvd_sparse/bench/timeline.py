"""How often each Horovod collective was negotiated in full and how often Horovod's response cache served it,
read from a Horovod timeline (``HOROVOD_TIMELINE=/path/t.json``, written by rank 0, the coordinator).

    python -m hvd_sparse.bench timeline t.json [--skip-first N]

A collective whose shape changes every step (a sparse exchange's allgather of k values, say) misses the response
cache and pays a full round of negotiation each step; one of a fixed shape is served from the cache after its first
step. The timeline tells them apart (Horovod 0.28.1, ``horovod/common/timeline.cc`` and ``controller.cc``):

- each tensor is a "process" of the Chrome trace: a metadata event ``{"name": "process_name", "ph": "M", "pid": i,
  "args": {"name": <tensor name>}}`` names row ``i`` (horovod.torch prefixes the op: ``allgather.<name>``);
- each collective begins with a span ``{"ph": "B", "name": "NEGOTIATE_<OP>", "pid": i}`` ... ``{"ph": "E"}``;
- in a full negotiation the coordinator marks each rank's request inside that span, ``Timeline::NegotiateRankReady``:
  ``{"ph": "X", "name": "<rank>", "dur": 0, "pid": i}``; a cache hit opens and closes the span without them.

Horovod writes the file as it goes, each event followed by ``]`` that the next one overwrites, so a job that dies
can leave it cut anywhere: the reader keeps every complete event before the cut.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NEGOTIATE = "NEGOTIATE_"


def read_events(path):
    """The trace's events in file order, up to the last complete one (no closing bracket needed)."""
    text, decoder, events = Path(path).read_text(), json.JSONDecoder(), []
    pos = text.find("[") + 1
    while pos:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            event, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:        # the end: "]", nothing, or an event cut short
            break
        events.append(event)
    return events


def cache_report(path, skip_first=0):
    """{tensor name: {"op", "calls", "negotiated", "cached"}} of the timeline at ``path``: "calls" counts the
    NEGOTIATE spans after the first ``skip_first`` of each name, "negotiated" those with per-rank ready marks,
    "cached" those without (response cache hits)."""
    names, marks, ops = {}, {}, {}          # pid -> tensor name; name -> ready marks per NEGOTIATE span; name -> op
    for e in read_events(path):
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[e["pid"]] = e["args"]["name"]
        elif e.get("pid") in names:
            name = names[e["pid"]]
            if e.get("ph") == "B" and e["name"].startswith(NEGOTIATE):
                marks.setdefault(name, []).append(0)
                ops[name] = e["name"][len(NEGOTIATE):]
            elif e.get("ph") == "X" and e["name"].isdigit() and marks.get(name):
                marks[name][-1] += 1
    report = {}
    for name, spans in sorted(marks.items()):
        spans = spans[skip_first:]
        negotiated = sum(1 for m in spans if m)
        report[name] = {"op": ops[name], "calls": len(spans), "negotiated": negotiated,
                        "cached": len(spans) - negotiated}
    return report


def markdown(report):
    lines = ["| collective | op | calls | negotiated | cached |", "|---|---|---:|---:|---:|"]
    lines += [f"| {name} | {r['op']} | {r['calls']} | {r['negotiated']} | {r['cached']} |"
              for name, r in report.items()]
    return "\n".join(lines)


def add_arguments(p):
    p.add_argument("timeline", help="the file HOROVOD_TIMELINE named")
    p.add_argument("--skip-first", type=int, default=0, metavar="N",
                   help="leave out each collective's first N calls (warm-up)")


def main(args):
    print(markdown(cache_report(args.timeline, args.skip_first)))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hvd_sparse.bench.timeline", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
