"""The comparison report of a re-run against the job it re-runs: pure computation over both outputs.

`pairs` reads the two outputs side by side, `figures` holds the distributions and histograms every task
shares, and `embed`, `text` and `classify` the figures of each task; `report` puts them together. The
service that reads, writes and serves the report is `portal.jobs.services.comparison`.
"""
