"""What `launch.submit` copies from the job's files to the console
(`job.output.stream_output`, `stream_errors`)."""
from job.output import stream_errors, stream_output

CONFIG_TB = ["Traceback (most recent call last):", '  File "/x/run_state.py", line 9, in open_run',
             "rl.config.ConfigError: reward.function: got 'x:y', cannot import module 'x'"]
FATAL_TB = ["Traceback (most recent call last):", '  File "/x/job.py", line 33, in start_local_ray',
            "    ray.init(num_cpus=2)",
            "Exception: The current node timed out during startup."]


def _append(path, *lines):
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def test_errors_show_whole_tracebacks_but_not_those_reported_as_one_line(tmp_path, capsys):
    err = tmp_path / "job.err"
    _append(err, "2026-11-30 14:04:31,604\tINFO worker.py:2038 -- Started a local Ray instance.",
            "Loading weights:   0%|   | 0/47\rLoading weights: 100%|###| 47/47",
            "ERROR submitit: Submitted job triggered an exception", *CONFIG_TB,
            "ERROR rl.loop: 3 non-finite steps in a row", *FATAL_TB[:2])
    pos = stream_errors(err, 0)
    # the open traceback is held back until its exception line arrives
    assert capsys.readouterr().err.splitlines() == ["ERROR rl.loop: 3 non-finite steps in a row"]
    _append(err, *FATAL_TB[2:])
    pos = stream_errors(err, pos)
    assert capsys.readouterr().err.splitlines() == FATAL_TB
    assert pos == err.stat().st_size


def test_quiet_stream_drops_submitits_own_lines_and_waits_for_whole_lines(tmp_path, capsys):
    out = tmp_path / "job.out"
    out.write_text("submitit INFO (2026-11-30 14:04:20,701) - Starting with JobEnvironment(...)\n"
                   "step    1/2 | reward 0.500\n"
                   "submitit ERROR (2026-11-30 14:19:24,255) - Submitted job triggered an exception\n"
                   "step    2/2 | rew")
    pos = stream_output(out, 0, quiet=True)
    assert capsys.readouterr().out == "step    1/2 | reward 0.500\n"
    with open(out, "a") as f:
        f.write("ard 0.750\n")
    stream_output(out, pos, quiet=True)
    assert capsys.readouterr().out == "step    2/2 | reward 0.750\n"
    stream_output(out, 0)  # not quiet (verbose, Slurm): everything as written
    assert capsys.readouterr().out.count("submitit") == 2
