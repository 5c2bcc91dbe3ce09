"""Process groups and collectives for tensor and pipeline parallelism (torch.distributed)."""
