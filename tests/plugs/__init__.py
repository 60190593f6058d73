"""Plugs written against earlier versions of `impl/interface.py`, for tests/test_plug_versions.py."""
