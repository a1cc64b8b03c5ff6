"""The bundled workflows, installed as the package data `wde.workflows` (see pyproject.toml).

A regular package, not a namespace one, so `importlib.resources.files("wde.workflows")` finds it in every kind
of install: setuptools' editable finder maps `wde.workflows` to this folder only when it has an `__init__.py`.
"""
