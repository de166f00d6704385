"""MLflow: runs and their metrics, dataset lineage, and each trial's logged model.

The only package that imports mlflow.
"""
