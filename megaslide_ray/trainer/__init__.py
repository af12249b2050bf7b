"""The driver: the Trainer loop and the components it delegates to (checkpointing, validation,
sampling, metrics), and the launch of a training run (Ray, signals, exit codes)."""
