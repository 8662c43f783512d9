"""l2l-hw tests. A regular package: pynq 4.0 installs a top-level `tests` package into
site-packages, which would otherwise shadow this folder."""
