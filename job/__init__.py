"""What runs inside a job, local or Slurm, and what both launchers share about it: the job body
(`run`), its failures and new lives (`failures`), the run directory's one writer (`rundir`),
RUN_DIR/lifecycle.jsonl (`lifecycle`), following a job's output files (`output`), and the Slurm
job environment (`slurm_env`).

Layering: `launch/` (the commands) imports `slurm/` (the allocation) and `job/`; `slurm/` imports
`job/`; `job/` imports neither (tests/test_layering.py)."""
