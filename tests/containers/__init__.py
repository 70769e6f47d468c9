"""The container suite (make test-containers): a package, so that its conftest does not shadow tests/conftest.py."""
