"""pytest options of the benchmark suites: `--bench-records DIR` writes each test's bench record
(bench/records.py); the figures (tok/s, limit, memory) are printed as a table after the run."""
from __future__ import annotations

RECORDS: list[dict] = []


def pytest_addoption(parser):
    parser.addoption("--bench-records", default=None, help="write the sweep's bench records to this directory")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not RECORDS:
        return
    tr = terminalreporter
    tr.write_sep("-", "figures (bench/harness.py records)")
    width = max(len(r["test"]) for r in RECORDS)
    tr.write_line(f"{'test':{width}s}  {'value':>12s}  unit   {'of limit':>8s}  {'peak RSS MB':>11s}")
    for r in RECORDS:
        ratio = f"{r['ratio_to_limit']:.0%}" if r["ratio_to_limit"] else "-"
        tr.write_line(f"{r['test']:{width}s}  {r['value']:12,.1f}  {r['unit']:5s}  {ratio:>8s}  "
                      f"{r['extra']['peak_rss_mb']:11.0f}")
    out = config.getoption("--bench-records")
    if out:
        from bench.records import write_records
        for path in write_records([{k: v for k, v in r.items() if k != "test"} for r in RECORDS], out):
            tr.write_line(f"wrote {path}")
