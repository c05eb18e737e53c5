"""The code that runs inside a probe process: build (model, data, optimizer, numerics), train (the
loop and its step log), hooks (the forensics replay), entry (spec in, record out) and worker (the warm
process probes are forked from). Nothing here imports the analysis, the reports or the run machinery."""
