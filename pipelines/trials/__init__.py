"""Ray: the Tune trials of a train stage run, their Ray Train workers, and starting or joining a cluster.

The only package that imports ray.
"""
