"""Run monitoring: TensorBoard scalars (`tensorboard`) and the HDF5 trajectory log (`trajectories`);
the same scalars to W&B and MLflow when configured (`sinks` fans them out, `tracking`,
`wandb_sink`, `mlflow_sink`; imported by the driver, not here).

A run directory holds `tensorboard/` (event files) and `trajectories.h5`; `python -m launch.inspect
RUN_DIR` summarises both. Importing this package does not import torch.
"""
from rl.metrics.tensorboard import (HISTOGRAM_TAGS, METRIC_TAGS, TENSORBOARD_SUBDIR, MetricsLogger,
                                    markdown_table)
from rl.metrics.trajectories import (FINISH_REASONS, SCHEMA_VERSION, TRAJECTORY_FILE, StepSummary,
                                     TrajectoryFileError, TrajectoryReader, TrajectoryWriter)

__all__ = [
    "FINISH_REASONS", "HISTOGRAM_TAGS", "METRIC_TAGS", "SCHEMA_VERSION", "TENSORBOARD_SUBDIR", "TRAJECTORY_FILE",
    "MetricsLogger", "StepSummary", "TrajectoryFileError", "TrajectoryReader", "TrajectoryWriter",
    "markdown_table",
]
