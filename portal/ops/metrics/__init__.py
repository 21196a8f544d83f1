"""The control side's Prometheus metrics, served at the portal's /metrics.

`families` names every control-side metric; `samples` writes the counters and histograms kept in
the database; `jobs` records what a job's ending adds; `collector` reads it all at scrape time,
with the gauges read from the database and Redis; `views` serves it.
"""
