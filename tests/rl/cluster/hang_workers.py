"""Workers that hang or die on request, for the deadline and fail-fast tests (importable by the
spawned processes and Ray's workers)."""
import os
import time


class Sleeper:
    """A trainer rank or engine whose calls hang (sleep) or kill its own process."""

    def __init__(self, die: bool = False):
        self.die = die

    def _act(self):
        if self.die:
            time.sleep(0.5)
            os._exit(1)  # a crash: no exception, the process is gone
        time.sleep(120)  # blocked, as in a collective with a dead peer

    def train_step(self, batch, step):
        self._act()

    def save(self, path, tag, client_state, checksum):
        self._act()

    def generate(self, prompts, sampling):
        self._act()

    def ping(self):
        return os.getpid()
