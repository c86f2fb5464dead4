"""``conftest.gpu_timeouts``: every gpu test gets a timeout (``pytest -m gpu -n 8`` on a GPU machine), where
pytest-timeout is installed, without overriding a run-wide one or a test's own."""

import pytest

import conftest


class _Item:
    def __init__(self, *marks):
        self.keywords = {m.name: m for m in marks}
        self.markers = list(marks)

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)

    def add_marker(self, mark):
        self.markers.append(mark.mark)

    def timeout(self):
        marker = self.get_closest_marker("timeout")
        return marker and marker.args[0]


class _Config:
    def __init__(self, plugin: bool, option=None, ini=""):
        self.pluginmanager = type("PM", (), {"hasplugin": staticmethod(lambda name: plugin and name == "timeout")})
        self.option, self.ini = option, ini

    def getoption(self, name, default=None):
        assert name == "timeout"
        return self.option

    def getini(self, name):
        assert name == "timeout" and self.pluginmanager.hasplugin("timeout")  # the ini exists with the plugin only
        return self.ini


def _items():
    return [_Item(pytest.mark.gpu.mark), _Item(), _Item(pytest.mark.gpu.mark, pytest.mark.timeout(600).mark)]


def test_gpu_tests_get_a_timeout(monkeypatch):
    monkeypatch.delenv("PYTEST_TIMEOUT", raising=False)
    items = _items()
    conftest.gpu_timeouts(_Config(plugin=True), items)
    assert [i.timeout() for i in items] == [conftest.GPU_TIMEOUT, None, 600]


@pytest.mark.parametrize("config, env", [(_Config(plugin=True, option=150.0), None), (_Config(plugin=True, ini="90"),
                                                                                      None),
                                         (_Config(plugin=True), "120"), (_Config(plugin=False), None)],
                         ids=["--timeout", "ini", "PYTEST_TIMEOUT", "no pytest-timeout"])
def test_a_run_wide_timeout_or_no_plugin_adds_nothing(monkeypatch, config, env):
    if env is None:
        monkeypatch.delenv("PYTEST_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_TIMEOUT", env)
    items = _items()
    conftest.gpu_timeouts(config, items)
    assert [i.timeout() for i in items] == [None, None, 600]
