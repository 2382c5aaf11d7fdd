"""The reproduction's claims of record: published findings as data (claims.py), compact
summaries of the runs that answer them (records.py), the written verdict rules (verdict.py)
and the report generated from them (report.py). Nothing here runs a simulation."""
