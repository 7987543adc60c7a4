"""Named deployments of the pipetune flows: ``prefect.yaml`` (work pool) and the serve
script (no work pool) that reads the same declarations. See ``deployments/README.md``."""
