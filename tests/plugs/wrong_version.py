"""A plug declaring an interface version the suite does not know (tests/test_plug_versions.py)."""


class Plugged:
    name = "wrong-version"
    interface_version = 99
