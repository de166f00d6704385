"""MLflow: runs and their metrics, dataset lineage, and each trial's logged model.

The only package that imports mlflow. Importing it turns MLflow 3's telemetry off in this process, unless the user
set `MLFLOW_DISABLE_TELEMETRY` (theirs wins), before mlflow is imported: the telemetry client pops
`_MLFLOW_TELEMETRY_SESSION_ID` from `os.environ` after it fails to reach its host, and a request thread iterating
`os.environ` at that moment raised `KeyError` in a trial (CI, issue 44's note). Trials run in processes we start,
offline more often than not; Ray's workers get the same setting (`pipelines.trials.ray_cluster.worker_env`).

It also bounds MLflow's own HTTP retries (again unless the user set them): by default its client retries a failed
request 7 times with doubling waits, about 5 minutes per call, so one artifact upload to a bucket that is down
took 303 s here. The pipeline retries at its own level, where it can say what it is waiting for: a trial buffers
its metrics while the server is away, and an upload is retried for `tracking.upload_retry_s` and then kept for
`--resume-upload` (`pipelines.tracking.uploads`). 3 retries with waits of 1, 2 and 4 s ride out a blip.
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
