"""Which files a framework's save wrote through ``adambridge.checkpoint.save``."""
import os

import adambridge.checkpoint


def record_streamed_saves(monkeypatch) -> list:
    """The paths ``adambridge.checkpoint.save`` writes from now on, in order (it still
    writes them)."""
    written, save = [], adambridge.checkpoint.save

    def recording(obj, f):
        written.append(os.fspath(f))
        save(obj, f)

    monkeypatch.setattr(adambridge.checkpoint, "save", recording)
    return written
