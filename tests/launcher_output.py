"""The output of `mgloop.launch.launch`, collected for the tests that read it while the
launcher runs (test_cluster, test_netns)."""

from __future__ import annotations

import re
import threading


class Lines:
    """The launcher's output, collected; `wait_for` a line (another thread writes)."""

    def __init__(self):
        self.text = ""
        self._changed = threading.Condition()

    def write(self, text):
        with self._changed:
            self.text += text
            self._changed.notify_all()

    def flush(self):
        pass

    def wait_for(self, pattern, timeout=120.0):
        with self._changed:
            self._changed.wait_for(lambda: re.search(pattern, self.text, re.M), timeout)
            return re.search(pattern, self.text, re.M)

    def pids(self):
        return [int(p) for p in re.findall(r"^\[launch\] worker \d .*\(pid (\d+)\)", self.text,
                                           re.M)]
