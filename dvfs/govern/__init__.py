"""Load-following caps for a running SGLang server, and live energy per token.

`plan` is the per-batch plan file, `policy` the pure rule that turns the running batch into a
plan step (hysteresis, minimum dwell), `metrics` reads the server's Prometheus page and joins
it with the GPUs' energy counters, `exporter` serves the results in the Prometheus text format,
and `loop` runs it all under the sweep's GPU safety layer. Nothing is re-exported: import the
module that does the job.
"""
