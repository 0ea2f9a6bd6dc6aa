"""Reports: per-request metrics and the summary row, the CSV / JSON / HTML files a run writes, the
end-of-run tables, and `kvtool compare`'s reading of reports side by side."""
