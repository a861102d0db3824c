"""The operational parts around the engine: metrics and health, systemd notify, the container health check,
logging, the output lock, the periodic-thread shape, test failpoints and lazily imported modules."""
