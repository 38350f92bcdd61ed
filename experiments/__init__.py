"""The benchmark kit and the studies' flagfiles (README.md beside this file).

Each entry runs as a module of this package from the repository root, `python -m
experiments.ENTRY [COMMAND] [flags]`, so that it imports mgloop and its sibling modules
(`from experiments import benchlib`) with no change to `sys.path`.
"""
