# Only the cffi hook lives here; all metadata is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["engine/_build.py:ffibuilder"])
