"""The router service (``kvrouter up``): HTTP front, partitions, metrics."""
