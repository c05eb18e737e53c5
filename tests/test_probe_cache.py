"""Runs that share the probe cache append to its probes.jsonl at the same time (issue 34): every record
each of them added reads back whole. Four real processes, records long enough that one takes several
write calls."""

import subprocess
import sys
import textwrap

from nandoctor.run.cache import ProbeCache

WRITER = textwrap.dedent(
    """
    import sys
    from nandoctor.cells import Cell
    from nandoctor.record import ProbeRecord
    from nandoctor.run.cache import ProbeCache

    cache, writer = ProbeCache(sys.argv[1]), sys.argv[2]
    for n in range(40):
        record = ProbeRecord("fp32/eager/off", Cell.parse("fp32/eager/off"), "ok", fingerprint=f"{writer}-{n}")
        record.log_tail = writer * 200_000  # one record: about 200 kB
        cache.add(record, "run")
    """
)


def test_four_runs_appending_at_once_leave_every_record_whole(tmp_path):
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], stderr=subprocess.PIPE, text=True)
        for name in "abcd"
    ]
    for w in writers:
        assert w.wait(timeout=120) == 0, w.stderr.read()
    lines = (tmp_path / "probes.jsonl").read_text().splitlines()
    assert len(lines) == 160
    found = ProbeCache(tmp_path)
    for name in "abcd":
        for n in range(40):
            record, _ = found.lookup(f"{name}-{n}")
            assert record.log_tail == name * 200_000
