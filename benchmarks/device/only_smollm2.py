"""pytest plugin for the device run: keep only the tests of the real model (the `smollm2` fixture);
the embedded model's weights do not travel there (the 64 MiB limit)."""


def pytest_collection_modifyitems(config, items):
    keep = [i for i in items if "smollm2" in getattr(i, "fixturenames", ())]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep
