"""Slurm integration: hetjob submission (`executor`), Ray inside the allocation (`ray_cluster`),
and a real single-machine test cluster (`testing/`)."""
