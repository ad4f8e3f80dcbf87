"""``epdserve plan``: which topology and E:PD ratio to run for a workload, from measured costs.

- ``profile``: the per-stage costs of this hardware as versioned JSON (``Profile``), and their fit
  from per-request samples (least squares);
- ``calibrate``: the samples of a short run against a live deployment (``X-EPD-Timing``), or of a
  sweep's cells;
- ``cores``: where a topology's processes run and how fast, sharing or lending cores;
- ``model``: the analytic queueing model of one topology under one workload (``predict``);
- ``planner``: candidates within a core budget, ranked, the recommendation and why; the command line.
"""
