"""Test fixtures that are real services: a Slurm cluster in network namespaces (cluster.py)
and an etcd server (etcd.py), started and stopped by the tests themselves."""
