"""The benchmark commands, `gmlx bench` (bench.py; `--url`: url.py) and `gmlx sweep-cap` (sweep.py),
and their parts, each imported only when its command runs (this file imports nothing):

- what is sent: workload.py (prompts, arrivals, budgets), fit.py (the workload against the context);
- driving it: driver.py (in-process backends, one loop), baselines.py (mlx-lm as backends),
  arms.py (the arms and the ABBA matrix), http_backend.py and target.py (a server over HTTP);
- what comes out: live.py (the live view and tables), results.py (per request, per cell, the
  files), summary.py (the printed summary), ideal.py (achieved against ideal), plots.py,
  report.py (bench's screen and files), outdir.py (--out checked first);
- sweep-cap's own: sweep_results.py (per-width tables), recommend.py (the cap and why).
"""
