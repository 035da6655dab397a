"""Fixtures of the producer's unit tests.

``recorder_impl``: runs a test once on the compiled engine path (``_fastrecorder``, which
``KVCacheEventManager`` uses when it is built) and once on the pure-Python one (``PyRecorder``,
the fallback). The manager's test modules use it for every test, so both implementations pass
the whole conformance suite.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["compiled", "python"])
def recorder_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from kvevents.producer import KVCacheEventManager
    from kvevents.producer._recorder import PyRecorder

    if request.param == "compiled":
        try:
            from kvevents.producer._fastrecorder import Recorder
        except ImportError:
            pytest.fail("kvevents.producer._fastrecorder is not built; run make setup", pytrace=False)
        monkeypatch.setattr(KVCacheEventManager, "_recorder_factory", Recorder)
    else:
        monkeypatch.setattr(KVCacheEventManager, "_recorder_factory", PyRecorder)
    return str(request.param)
