"""kvevents' pytest plugin: the README's "Testing your router against kvevents" example runs as
written in a fresh pytest (the plugin found through its entry point), and this suite's own
fixtures come from the plugin alone (registered once)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvevents.pytest_plugin as plugin

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_example() -> str:
    text = README.read_text()
    section = text.split("## Testing your router against kvevents", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section should hold exactly one complete example test"
    return blocks[0]


@pytest.mark.slow
def test_the_readme_example_passes_in_a_fresh_pytest(pytester: pytest.Pytester, kafka_bootstrap: str) -> None:
    pytester.makepyfile(test_router=_readme_example())
    pytester.makeini("[pytest]\n")  # not this project's settings
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)  # the session's broker, not a new one
        result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)


def test_a_fresh_pytest_marks_and_skips_without_kafka(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marked="""
def test_uses_kafka(kafka_topic):
    pass

def test_plain():
    pass
"""
    )
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-q", "-m", "not kafka")
    result.assert_outcomes(passed=1, deselected=1)


def test_this_suite_gets_each_fixture_once_from_the_plugin(request: pytest.FixtureRequest) -> None:
    manager = request._fixturemanager
    for name in ("kafka", "kafka_bootstrap", "kafka_topic", "kafka_topic_factory", "kvevents_stream",
                 "schema_registry_url"):  # fmt: skip
        definitions = manager.getfixturedefs(name, request.node)
        assert definitions is not None and len(definitions) == 1, name
        assert definitions[0].func.__module__ == plugin.__name__, name


def test_a_broker_death_during_a_test_errors_that_test_and_no_other(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import pytest

class Dies:
    def __init__(self):
        self.checks = 0

    def revive(self):
        self.checks += 1
        return "the broker had died; restarted it" if self.checks == 2 else None

@pytest.fixture(scope="session")
def kafka():
    return Dies()
"""
    )
    pytester.makepyfile(
        test_order="""
def test_first(kafka):
    pass

def test_second_sees_it_die(kafka):
    pass

def test_plain():
    pass

def test_third(kafka):
    pass
"""
    )
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*during test_order.py::test_second_sees_it_die: the broker had died*"])
