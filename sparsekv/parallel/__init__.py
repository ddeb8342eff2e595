"""Running one model across ranks on torch.distributed: layouts, collectives, executors (docs/parallel.md)."""
