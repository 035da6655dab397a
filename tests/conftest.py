"""Shared fixtures come from kvevents' own pytest plugin (``kvevents.pytest_plugin``, loaded
through its ``pytest11`` entry point when the package is installed, as ``make setup`` does):
``kafka``, ``kafka_bootstrap``, ``kafka_topic``, ``kafka_topic_factory``, ``kvevents_stream``
and ``schema_registry_url``. They are not defined again here, so each is registered once.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("kvevents"):
        raise pytest.UsageError(
            "kvevents' pytest plugin is not loaded: install the package ('make setup') "
            "and do not disable it with -p no:kvevents"
        )


pytest_plugins = ["pytester"]  # tests/integration/test_pytest_plugin.py runs the README's example
