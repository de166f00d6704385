"""MLflow: runs and their metrics, dataset lineage, and each trial's logged model.

The only package that imports mlflow. Importing it turns MLflow 3's telemetry off in this process, unless the user
set `MLFLOW_DISABLE_TELEMETRY` (theirs wins), before mlflow is imported: the telemetry client pops
`_MLFLOW_TELEMETRY_SESSION_ID` from `os.environ` after it fails to reach its host, and a request thread iterating
`os.environ` at that moment raised `KeyError` in a trial (CI, issue 44's note). Trials run in processes we start,
offline more often than not; Ray's workers get the same setting (`pipelines.trials.ray_cluster.worker_env`).
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
