"""Several specfleet replicas behind one cache-aware router (`specfleet cluster`; docs/cluster.md)."""
