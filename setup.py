"""Packaging shim: everything is declared in setup.cfg."""
from setuptools import setup

setup()
