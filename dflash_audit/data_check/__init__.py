"""`dflash-audit data-check`: an offline hidden-state dataset, as the field's writers lay it out (records.py), what it
claims (claims.py), each stored layer named by value against the target (naming.py), its loss_mask (loss_mask.py),
the findings by root cause (check.py), the reports (report.py), the verb's settings and run (run.py)."""
