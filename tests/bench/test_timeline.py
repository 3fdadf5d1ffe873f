"""hvd_sparse.bench.timeline on real 2-rank jobs: the timeline tells a collective of a fixed shape (served by Horovod's
response cache after its first call) from one whose shape changes every call (negotiated in full each time); every
collective of a steady hvd_sparse step is served from the cache (docs/algorithms.md#the-wire); and a trace cut
anywhere, as a job that dies leaves it, still reads up to its last complete event."""

import re

import pytest

from hvd_sparse.bench import timeline

from horovod_helpers import horovodrun, requires_horovod

#: the Horovod collectives of a steady step, per preset (the opening's name is shared by every unit; the others carry
#: the unit's name, "model.<i>" for the job's i-th optimizer, written "model" here)
STEADY = {"topka": {"allgather.hvd_sparse.agree"}, "gaussiank": {"allgather.hvd_sparse.agree"},
          "dct": {"allgather.hvd_sparse.agree"},
          "exdyna": {"allgather.hvd_sparse.agree", "allreduce.hvd_sparse.model.values"},   # a name per size
          "oktopk": {"allgather.hvd_sparse.agree", "alltoall.hvd_sparse.model.split",
                     "alltoall.hvd_sparse.model.gather"}}        # on the host an alltoall of the real pairs
#: the rung a collective of a ladder of sizes adds to its name (ExDyna's values on the host: reducers.base.size_bucket)
RUNG = re.compile(r"\.values\.\d+$")


def cut_at_the_end(path, ranks=2):
    """Names whose last NEGOTIATE span in the timeline at ``path`` has ready marks from some ranks only: the next
    preset's first call, which a rank that ran ahead began before rank 0's timeline switched files (Horovod's
    coordinator writes the timeline and switches files on a later cycle than ``stop_timeline``)."""
    names, last = {}, {}
    for e in timeline.read_events(path):
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {}):
            names[e["pid"]] = e["args"]["name"]
        elif e.get("pid") in names and e.get("ph") == "B" and e["name"].startswith(timeline.NEGOTIATE):
            last[names[e["pid"]]] = 0
        elif e.get("pid") in names and e.get("ph") == "X" and e["name"].isdigit() and names[e["pid"]] in last:
            last[names[e["pid"]]] += 1
    return {name for name, marks in last.items() if 0 < marks < ranks}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """{name: its timeline} of one job: the probe, then 12 training steps of each preset (tests/hvd_workers)."""
    out = tmp_path_factory.mktemp("timelines")
    names = ["probe", *STEADY]
    horovodrun(2, "timeline_worker.py", out, *names, timeout=180, env={"HOROVOD_TIMELINE": "DYNAMIC"})
    return {name: out / f"{name}.json" for name in names}


@pytest.mark.horovod
@requires_horovod
def test_fixed_shape_is_cached_and_a_changing_shape_is_negotiated_every_call(traces):
    report = timeline.cache_report(traces["probe"])
    assert set(report) == {"allgather.fixed", "allgather.varying"}      # horovod.torch prefixes the op
    assert report["allgather.varying"] == {"op": "ALLGATHER", "calls": 20, "negotiated": 20, "cached": 0}
    fixed = report["allgather.fixed"]
    assert fixed["op"] == "ALLGATHER" and fixed["calls"] == 20
    assert timeline.cache_report(traces["probe"], skip_first=1)["allgather.fixed"]["cached"] >= 18
    assert "| allgather.fixed | ALLGATHER | 20 |" in timeline.markdown(report)


@pytest.mark.horovod
@requires_horovod
@pytest.mark.parametrize("preset", sorted(STEADY))
def test_every_collective_of_a_steady_step_is_served_by_the_response_cache(traces, preset):
    """After the first steps (the optimizer's gather, the first step, ExDyna's start-up threshold), each step makes
    exactly the preset's documented collectives, once each, and Horovod negotiates none of them. One span more is
    left out: Horovod writes the timeline from a thread of its own, so on a loaded machine the shared opening of the
    previous preset's last step can land at the start of this preset's file, and the next preset's first call, begun
    by one rank, at its end (:func:`cut_at_the_end`). A collective whose size is one of a ladder (ExDyna's values on
    the host) has a name per size: each is negotiated on its first call only."""
    whole, report = timeline.cache_report(traces[preset]), timeline.cache_report(traces[preset], skip_first=4)
    for name in cut_at_the_end(traces[preset]):
        whole[name]["calls"] -= 1
        whole[name]["negotiated"] -= 1
        report[name] = dict(report[name], calls=report[name]["calls"] - 1,
                            negotiated=report[name]["negotiated"] - 1)
    steady = {}
    for name, row in report.items():
        key = RUNG.sub(".values", re.sub(r"\.model\.\d+\.", ".model.", name))
        if RUNG.search(name):       # every call of the size but its first, counted under the ladder's name
            row = {"calls": whole[name]["calls"], "negotiated": whole[name]["negotiated"] - 1}
            if key in steady:
                row = {field: steady[key][field] + row[field] for field in row}
        if row["calls"]:
            steady[key] = row
    assert set(steady) == STEADY[preset], steady
    assert all(row["negotiated"] == 0 and row["calls"] >= 8 for row in steady.values()), steady


def test_a_trace_cut_anywhere_reads_up_to_its_last_complete_event(tmp_path):
    # as Horovod 0.28.1 writes it (timeline.cc): a negotiated call (rank marks "0", "1"), then a cache hit
    text = ('[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":1}},\n'
            '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allgather.x"}},\n'
            '{"ph": "B", "name": "NEGOTIATE_ALLGATHER", "ts": 1, "pid": 1},{"ph": "X", "name": "0", "ts": 2, '
            '"pid": 1, "dur": 0},{"ph": "X", "name": "1", "ts": 3, "pid": 1, "dur": 0},{"ph": "E", "ts": 4, '
            '"pid": 1},{"ph": "B", "name": "NEGOTIATE_ALLGATHER", "ts": 5, "pid": 1},{"ph": "E", "ts": 6, "pid": 1}]')
    path = tmp_path / "t.json"
    for end, want in [(len(text), (2, 1, 1)), (len(text) - 1, (2, 1, 1)), (text.rindex('{"ph": "E"') + 5, (2, 1, 1)),
                      (text.rindex('{"ph": "B"') + 5, (1, 1, 0)), (text.index('"name": "1"'), (1, 1, 0)), (0, None)]:
        path.write_text(text[:end])
        got = timeline.cache_report(path).get("allgather.x")
        assert (got and (got["calls"], got["negotiated"], got["cached"])) == want, end
