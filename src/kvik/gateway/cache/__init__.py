"""Response cache for deterministic requests: memory or Redis behind `ResponseCache`."""
