"""``omlx router``: one endpoint in front of several omlx servers (prefix-affinity
and least-loaded routing, health checks, memory-control fan-out)."""
