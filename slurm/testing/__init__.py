"""A real Slurm cluster on one machine for tests and CI (`start.sh`, `stop.sh`), plus the small
functions the tests submit to it (`probes`)."""
