"""Read-only tools over a log: fold to any point, staleness analysis, audit, policy what-if."""
