"""The engine: round loop, client hosts, backends, cluster, evaluation, metrics."""
