"""Train-loop hooks the tests share."""

from __future__ import annotations

import os
import signal
import time


class SigtermAt:
    """A hook that sends this process SIGTERM after step `step` (a pre-emption notice): the
    loop saves at that step and raises `Preempted`, as a pre-empted VM's run would stop."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, info):
        if info.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # let the handler run, as a real notice arrives asynchronously

    def at_end(self, info):
        pass
