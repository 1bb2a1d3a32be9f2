"""Following a job: what its output files gained since the last look, copied to the console
(`stream_output`, `stream_errors`; used by `launch.submit` and `slurm.sbatch`)."""
from __future__ import annotations

import sys
from pathlib import Path

# Tracebacks the launchers report as one line themselves (or that are no error at all).
_ONE_LINE_EXCEPTIONS = ("ConfigError", "Requeue")
_JOB_FAILED = "Submitted job triggered an exception"  # submitit's, before the traceback


def stream_errors(path: Path, pos: int) -> int:
    """The errors in what the job's stderr gained since `pos`, printed to stderr: whole
    tracebacks (except those of _ONE_LINE_EXCEPTIONS) and other ERROR / `...Error:` lines.

    Returns the position to read from next: the end of the last complete line, or the start of
    a traceback whose exception line has not arrived yet (it is judged once complete).
    """
    if not path.exists():
        return pos
    with open(path, "rb") as f:
        f.seek(pos)
        chunk = f.read()
    done = offset = 0  # bytes judged; bytes read
    block = None  # the open traceback's lines
    for raw in chunk.split(b"\n")[:-1]:  # whole lines only (a progress bar's \r stays inside)
        offset += len(raw) + 1
        line = raw.decode(errors="replace").rstrip("\r")
        if block is not None:
            block.append(line)
            if not line or line[0].isspace():
                continue
            if not line.split(":", 1)[0].endswith(_ONE_LINE_EXCEPTIONS):
                print("\n".join(block), file=sys.stderr, flush=True)
            block = None
        elif line.startswith("Traceback"):
            block = [line]
            continue
        elif (line.startswith("ERROR") or "Error:" in line) and _JOB_FAILED not in line:
            print(line, file=sys.stderr, flush=True)
        done = offset
    return pos + done


def stream_output(path: Path, pos: int, quiet: bool = False, out=None) -> int:
    """Copies what `path` gained since `pos` to `out` (stdout); returns the new position.
    `quiet` drops submitit's own lines (job started, pickle loaded, job completed or failed)."""
    out = out or sys.stdout
    if path.exists():
        with open(path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
        if quiet:  # only whole lines, so that a line cut by the read is judged once complete
            chunk = chunk[:chunk.rfind(b"\n") + 1]
        if chunk:
            text = chunk.decode(errors="replace")
            if quiet:  # run_local reports the outcome itself
                text = "".join(ln for ln in text.splitlines(keepends=True)
                               if not (ln.startswith("submitit INFO") or _JOB_FAILED in ln))
            out.write(text)
            out.flush()
            pos += len(chunk)
    return pos
