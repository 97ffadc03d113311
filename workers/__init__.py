"""Workers: trainer, rollout generators, tasks, models, the data plane adapter and weight sync."""
