"""The training loop (``trainer.Trainer``) and its services: checkpoints, metrics, validation, profiling, the
process group, the run status file and fault tolerance."""
