"""The code that runs inside a probe process: build (model, data, optimizer, numerics), train (the
loop and its step log), hooks (the forensics replay), entry (spec in, record out), outcome (how a
probe reports), worker (the warm process probes are forked from), and for a parallel cell launch (the
W ranks as one probe) and parallel (one rank). Nothing here imports the analysis, the reports or the
run machinery."""
